"""Store fetches in a process of their own, landing in host memory the worker shares with it.

Why a process. A fetch is socket reads, protobuf parsing, CRC-32C and sha256 checks and writes
into the host buffer: about 0.16 s of CPU per 78 MB adapter here. In the worker's process that
work runs on gRPC's own threads, which also deliver every generated token, so it cannot be given
a lower priority without slowing the token stream; and on a CPU it takes cores from the two
OpenMP threads of the decode step, which wait for each other at the end of every parallel op, so
each time slice taken from either stalls both. Measured on the default model with 4 streams
decoding while rank-64 adapters were fetched back to back: ITL p50 136 ms with the fetch at
normal priority, 75 ms with it in a process at SCHED_IDLE, 72 ms with no fetch
(docs/notes/loading.md).
In its own process every thread of the fetch runs at the priority it set for itself, and none of
them holds the worker's GIL.

How the bytes get back. The host tier's arena is one ``memfd`` both processes map
(:class:`SharedHostMemory`); the worker reserves a range for the adapter, the fetch process
lands and verifies the chunks there, and replies with the manifest. Nothing is copied between the
processes. On CUDA the mapping is pinned in place (``Device.pin_host``). On the way it reports
each time more of the adapter's leading layers have landed, verified (``on_layers``).

If the fetch process dies, the fetches it had fail with a clear error and the next fetch starts
a new one.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future
from multiprocessing.connection import Connection

import torch

from lorastream.core.errors import LorastreamError, SourceUnavailable
from lorastream.core.manifest import AdapterManifest
from lorastream.core.tls import ClientTLS
from lorastream.worker.device.device import Device
from lorastream.worker.loading.fetch_child import map_shared
from lorastream.worker.loading.layer_progress import LayersCallback

log = logging.getLogger(__name__)

_Fetched = tuple[AdapterManifest, float]  # the manifest landed, and the seconds spent landing it


class SharedHostMemory:
    """``[nbytes]`` uint8 host memory that the worker and its fetch process both map."""

    def __init__(self, device: Device, nbytes: int, prefault: bool = False) -> None:
        self.nbytes = nbytes
        self.prefault = prefault  # every page taken and mapped now, in both processes
        self.fd = os.memfd_create("lorastream-host-adapters", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, nbytes)  # without prefault, pages are taken as adapters land
        self._map = map_shared(self.fd, nbytes, prefault)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)  # [nbytes]
        device.pin_host(self.tensor)

    @staticmethod
    def supported() -> bool:
        return hasattr(os, "memfd_create")

    def offset_of(self, view: torch.Tensor) -> int | None:
        """Where ``view`` starts in this memory; None if it lies (partly) outside."""
        start = view.data_ptr() - self.tensor.data_ptr()
        return start if 0 <= start and start + view.numel() <= self.nbytes else None

    def holds(self, view: torch.Tensor) -> bool:
        return self.offset_of(view) is not None


class _Child:
    """One running fetch process and the jobs sent to it."""

    def __init__(self, memory: SharedHostMemory, store: str, token: str | None, threads: int,
                 priority: str, tls: ClientTLS | None) -> None:
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lorastream.worker.loading.fetch_child",
             "--memory-fd", str(memory.fd), "--memory-bytes", str(memory.nbytes),
             "--conn-fd", str(theirs.fileno()), "--priority", priority,
             *(["--prefault"] if memory.prefault else [])],
            pass_fds=(memory.fd, theirs.fileno()),
        )
        theirs.close()
        self._socket = ours  # shut down on close: that wakes the reader blocked on it
        self.conn = Connection(os.dup(ours.fileno()))
        self.jobs: dict[int, Future[_Fetched]] = {}
        self.on_layers: dict[int, LayersCallback] = {}  # of the jobs that asked
        self.lock = threading.Lock()  # guards jobs, on_layers and sends
        self.alive = True
        self.conn.send(("init", store, token, threads, tls))
        self.reader = threading.Thread(target=self._read, name="fetch-replies", daemon=True)
        self.reader.start()
        log.info("fetch process %d started (priority %s)", self.proc.pid, priority)

    def submit(self, job: int, message: tuple[object, ...],
               on_layers: LayersCallback | None = None) -> Future[_Fetched]:
        future: Future[_Fetched] = Future()
        with self.lock:
            if not self.alive:
                raise SourceUnavailable("the adapter fetch process exited; retry the request")
            self.jobs[job] = future
            if on_layers is not None:
                self.on_layers[job] = on_layers
            self.conn.send(message)
        return future

    def _read(self) -> None:
        try:
            while True:
                kind, job, *rest = self.conn.recv()
                if kind == "layers":
                    self._report_layers(job, rest[0])
                    continue
                with self.lock:
                    future = self.jobs.pop(job)
                    self.on_layers.pop(job, None)
                if kind == "done":
                    future.set_result((rest[0], rest[1]))
                else:
                    future.set_exception(rest[0])
        except (EOFError, OSError):
            pass
        code = self.proc.wait()
        with self.lock:
            self.alive = False
            failed, self.jobs, self.on_layers = list(self.jobs.values()), {}, {}
        if failed or code:
            log.warning("fetch process %d exited with code %s; %d fetches failed",
                        self.proc.pid, code, len(failed))
        for future in failed:
            future.set_exception(SourceUnavailable(
                f"the adapter fetch process exited (code {code}) during the fetch; retry the "
                "request"
            ))

    def _report_layers(self, job: int, count: int) -> None:
        """Call ``job``'s layers callback, if it gave one; its failure fails nothing here."""
        with self.lock:
            callback = self.on_layers.get(job)
        if callback is None:
            return
        try:
            callback(count)
        except Exception:  # noqa: BLE001 - the reader serves every job: it must go on
            log.exception("layers callback of fetch job %d failed", job)

    def close(self) -> None:
        with self.lock:
            self.alive = False
        try:
            self._socket.shutdown(socket.SHUT_RDWR)  # the child sees EOF, and exits
        except OSError:
            pass  # already gone
        self._socket.close()
        self.reader.join(timeout=5)
        self.conn.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class FetchProcess:
    """Fetches adapters from the store in a child process, into :class:`SharedHostMemory`."""

    def __init__(self, memory: SharedHostMemory, store: str, token: str | None = None, *,
                 threads: int = 1, priority: str = "idle", tls: ClientTLS | None = None) -> None:
        self.memory = memory
        self._args = (memory, store, token, threads, priority, tls)
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._child = _Child(*self._args)

    @property
    def pid(self) -> int:
        return self._child.proc.pid

    def fetch(self, name: str, storage: torch.Tensor, chunk_bytes: int = 0,
              chunk_delay_s: float = 0.0, on_layers: LayersCallback | None = None) -> _Fetched:
        """Land ``name``'s tensors in ``storage`` (a range of the shared memory), verified;
        returns its manifest and the seconds spent landing chunks. Blocks until done.

        ``on_layers(count)`` is called, on the thread that reads the fetch process's replies,
        each time the count of the adapter's leading layers landed and verified grows (all
        calls come before this returns); an exception it raises is logged and ignored."""
        offset = self.memory.offset_of(storage)
        assert offset is not None, "storage outside the shared host memory"
        with self._lock:
            if not self._child.alive:
                self._child.close()
                self._child = _Child(*self._args)
            child, job = self._child, next(self._ids)
        message = ("fetch", job, name, offset, storage.numel(), chunk_bytes, chunk_delay_s)
        try:
            return child.submit(job, message, on_layers).result()
        except LorastreamError:
            raise
        except (OSError, ValueError) as err:  # the connection broke under the send
            raise SourceUnavailable(f"the adapter fetch process is gone: {err!r}") from err

    def close(self) -> None:
        self._child.close()
