"""The fetch process: streams adapters from the store into the worker's shared host memory.

Started by :class:`~lorastream.worker.loading.fetch.FetchProcess` as
``python -m lorastream.worker.loading.fetch_child --memory-fd M --conn-fd C --priority P``.
It lowers its own CPU priority first, before anything starts a thread, so that every thread of
it -- gRPC's included -- runs at that priority, and has glibc keep freed message buffers
(``native_env.keep_freed_buffers``). Then it serves jobs from the connection:

    -> ("init", store_target, store_token, threads, store_tls)   store_tls: ClientTLS | None
    -> ("fetch", job, name, offset, nbytes, chunk_bytes, chunk_delay_s)
    <- ("layers", job, count)   the adapter's first ``count`` layers landed, verified (sent as
                                the count grows, before "done"; layers per the manifest,
                                ``layer_progress.LayerProgress``)
    <- ("done", job, manifest, times)   landed at [offset, offset + nbytes), verified;
                                        times: ``landing.FetchTimes`` (this process's CPU)
    <- ("error", job, LorastreamError)

and exits when the connection closes. No torch here: it starts in a fraction of a second and
holds only the shared mapping and its gRPC channel.
"""

from __future__ import annotations

import argparse
import mmap
import os
import time

from lorastream.worker.device.cpu.native_env import keep_freed_buffers
from lorastream.worker.device.cpu.priority import lower_priority


def map_shared(fd: int, nbytes: int, prefault: bool) -> mmap.mmap:
    """Map ``nbytes`` of the memory file ``fd`` shared; ``prefault``: take and map every page now
    (``MAP_POPULATE``) rather than on its first write. A page's first write otherwise faults in
    the process that writes it (the fetch process, beside decoding) and, the first time in
    either process, allocates and zeroes it: that was about half the fetch process's CPU per
    adapter landed in fresh memory (0.36-0.46 s against 0.18-0.19 s per 78 MB adapter)."""
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if prefault else 0)
    return mmap.mmap(fd, nbytes, flags=flags)


def serve(memory_fd: int, memory_bytes: int, conn_fd: int, prefault: bool = False) -> None:
    import logging
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from multiprocessing.connection import Connection

    import numpy as np

    from lorastream.core.errors import LorastreamError, SourceUnavailable
    from lorastream.core.store_client import StoreClient
    from lorastream.worker.loading.landing import LandingBuffer, SlowSink

    log = logging.getLogger("lorastream.fetch")
    conn = Connection(conn_fd)
    # the worker's host arena; prefault: the worker took every page, this maps them all now
    memory = np.frombuffer(map_shared(memory_fd, memory_bytes, prefault), dtype=np.uint8)
    _, target, token, threads, tls = conn.recv()
    client = StoreClient(target, token, tls=tls)
    send_lock = threading.Lock()

    def reply(message: tuple[object, ...]) -> None:
        with send_lock:
            conn.send(message)

    def fetch(job: int, name: str, offset: int, nbytes: int, chunk_bytes: int,
              delay_s: float) -> None:
        try:
            buffer = LandingBuffer(memory[offset : offset + nbytes],
                                   on_layers=lambda count: reply(("layers", job, count)))
            sink = SlowSink(buffer, delay_s) if delay_s else buffer
            began, cpu = time.perf_counter(), time.process_time()
            manifest = client.stream_tensors(name, sink, chunk_bytes=chunk_bytes)
            buffer.times.wall_s = time.perf_counter() - began
            buffer.times.cpu_s = time.process_time() - cpu  # every thread of this process
            reply(("done", job, manifest, buffer.times))
        except LorastreamError as err:
            reply(("error", job, err))
        except Exception as err:
            log.exception("fetching %s failed", name)
            reply(("error", job, SourceUnavailable(f"fetching adapter {name} failed: {err!r}")))

    pool = ThreadPoolExecutor(threads, thread_name_prefix="fetch")
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the worker closed the connection, or exited
            break
        pool.submit(fetch, *message[1:])
    client.close()
    os._exit(0)  # fetches still running have no one to report to


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-fd", type=int, required=True)
    parser.add_argument("--memory-bytes", type=int, required=True)
    parser.add_argument("--conn-fd", type=int, required=True)
    parser.add_argument("--prefault", action="store_true", help="map every page of it now")
    parser.add_argument("--priority", default="idle", help="idle, or nice:N")
    args = parser.parse_args()
    lower_priority(args.priority)  # before any thread starts: they all inherit it
    keep_freed_buffers()  # before the first message: each would fault in fresh pages
    serve(args.memory_fd, args.memory_bytes, args.conn_fd, args.prefault)


if __name__ == "__main__":
    main()
