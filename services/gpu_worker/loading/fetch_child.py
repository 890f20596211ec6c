"""The fetch process: streams adapters from the store into the worker's shared host memory.

Started by :class:`~services.gpu_worker.loading.fetch_process.FetchProcess` as
``python -m services.gpu_worker.loading.fetch_child --memory-fd M --conn-fd C --priority P``.
It lowers its own CPU priority first, before anything starts a thread, so that every thread of
it -- gRPC's included -- runs at that priority. Then it serves jobs from the connection:

    -> ("init", store_target, store_token, threads)
    -> ("fetch", job, name, offset, nbytes, chunk_bytes, chunk_delay_s)
    <- ("done", job, manifest, landing_seconds)   landed at [offset, offset + nbytes), verified
    <- ("error", job, LorastreamError)

and exits when the connection closes. No torch here: it starts in a fraction of a second and
holds only the shared mapping and its gRPC channel.
"""

from __future__ import annotations

import argparse
import os

from services.gpu_worker.priority import lower_priority


def serve(memory_fd: int, conn_fd: int) -> None:
    import logging
    import mmap
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from multiprocessing.connection import Connection

    import numpy as np

    from lorastream.errors import LorastreamError, SourceUnavailable
    from lorastream.store_client import StoreClient
    from services.gpu_worker.loading.landing import LandingBuffer, SlowSink

    log = logging.getLogger("lorastream.fetch")
    conn = Connection(conn_fd)
    memory = np.frombuffer(mmap.mmap(memory_fd, 0), dtype=np.uint8)  # the worker's host arena
    _, target, token, threads = conn.recv()
    client = StoreClient(target, token)
    send_lock = threading.Lock()

    def reply(message: tuple[object, ...]) -> None:
        with send_lock:
            conn.send(message)

    def fetch(job: int, name: str, offset: int, nbytes: int, chunk_bytes: int,
              delay_s: float) -> None:
        try:
            buffer = LandingBuffer(memory[offset : offset + nbytes])
            sink = SlowSink(buffer, delay_s) if delay_s else buffer
            manifest = client.stream_tensors(name, sink, chunk_bytes=chunk_bytes)
            reply(("done", job, manifest, buffer.landing_seconds))
        except LorastreamError as err:
            reply(("error", job, err))
        except Exception as err:  # noqa: BLE001 - reported to the worker, which fails the adapter
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
    parser.add_argument("--conn-fd", type=int, required=True)
    parser.add_argument("--priority", default="idle", help="idle, or nice:N")
    args = parser.parse_args()
    lower_priority(args.priority)  # before any thread starts: they all inherit it
    serve(args.memory_fd, args.conn_fd)


if __name__ == "__main__":
    main()
