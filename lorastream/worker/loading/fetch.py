"""Bring adapters into host memory: reserve their bytes, fetch them from the store, check them
against the base model (rule 6) before anything can copy them into a slot.

A load is three calls, which the adapter manager makes in order (``AdapterManager._fetch``):
:meth:`HostLoader.begin` (with the manager's lock held: the checks, the reservation),
:meth:`HostLoader.fetch` (without it, on a fetch thread or the caller's: the store stream and the
check), :meth:`HostLoader.end` (with the lock again: the weights, or the error, recorded). A failed
fetch fails the adapter with its error (rule 5), never the worker. While a fetch runs, the fetcher
reports the adapter's leading layers as they land verified (the store streams them in layer
order); the manager records them on the entry.

Fetch an adapter's tensors into a host buffer: from the store by name, or from a local dir.

Either way the bytes land chunk by chunk at their offsets in one preallocated host buffer and
every tensor's digest (``core/checksum.py``: the manifest's fast one, else sha256) is checked
before anything else sees it. Store fetches into the host arena run in the fetch process when
there is one (``fetch.py`` says why), else in the calling thread. Either way a store
fetch reports, through ``on_layers``, each time more of the adapter's leading layers have landed
verified (the store streams them in layer order; ``landing.py``). ``chunk_delay_s`` is a
test hook that slows every landed chunk, so tests can hold a load in flight.

Store fetches in a process of their own, landing in host memory the worker shares with it.

Why a process. A fetch is socket reads, protobuf parsing, CRC-32C and sha256 checks and writes
into the host buffer, a CPU cost that grows with the adapter's bytes. In the worker's process that
work runs on gRPC's own threads, which also deliver every generated token, so it cannot be given
a lower priority without slowing the token stream; and on a CPU it takes cores from the two
OpenMP threads of the decode step, which wait for each other at the end of every parallel op, so
each time slice taken from either stalls both. With the fetch at normal priority the running
streams' ITL nearly doubled; in a process at SCHED_IDLE it stayed near the no-fetch figure
(measured in docs/notes/loading.md, "Fetches in a process of their own").
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

import contextlib
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from lorastream.core.adapter_validation import content_id, validate_adapter_dir
from lorastream.core.checksum import verify_tensor
from lorastream.core.errors import (
    AdapterNotFound,
    CapacityExhausted,
    InvalidAdapter,
    InvalidArgument,
    LorastreamError,
    SourceUnavailable,
)
from lorastream.core.manifest import AdapterManifest
from lorastream.core.store_client import StoreClient
from lorastream.core.tls import ClientTLS
from lorastream.core.versions import pinned_ref
from lorastream.worker.device.device import Device
from lorastream.worker.loading.adapter import AdapterEntry, AdapterWeights, adapter_weights
from lorastream.worker.loading.device_tier import AdmissionCostModel
from lorastream.worker.loading.fetch_child import map_shared
from lorastream.worker.loading.host import HostAdapterBuffer, HostTier
from lorastream.worker.loading.landing import (
    FetchTimes,
    LayersCallback,
    SlowSink,
    host_nbytes,
    manifest_layers,
)
from lorastream.worker.lora.vocab import VocabBudget
from lorastream.worker.metrics import WorkerMetrics
from lorastream.worker.model.config import ModelConfig

log = logging.getLogger(__name__)


class HostLoader:
    def __init__(
        self,
        host: HostTier,
        fetcher: AdapterFetcher,
        config: ModelConfig,
        max_rank: int,
        metrics: WorkerMetrics,
        cost_model: AdmissionCostModel,
        vocab_budget: VocabBudget | None = None,
    ) -> None:
        self.host = host
        self.fetcher = fetcher
        self.config = config
        self.max_rank = max_rank
        self.vocab_budget = vocab_budget
        self.metrics = metrics
        self._cost_model = cost_model
        self._fetches = 0  # store fetches in flight (entries with ``fetching`` set)

    @property
    def fetching(self) -> bool:
        """Whether a store fetch is in flight (read without the lock: a hint for one gap)."""
        return self._fetches > 0

    def begin(self, entries: Iterable[AdapterEntry], entry: AdapterEntry) -> bool:
        """Reserve ``entry``'s host bytes (evicting idle ones among ``entries``) and mark its
        fetch begun; True when the caller is to :meth:`fetch` it now. False when it is in host
        memory, on its way, failed (now or before), or waits for room (retried at the next
        step). Call it with the manager's lock held."""
        if entry.weights is not None or entry.fetching or entry.error is not None:
            return False
        if entry.local_path is not None:
            entry.fail(AdapterNotFound(
                f"adapter {entry.name} was evicted from this worker; load it again"
            ))
            return False
        need = host_nbytes(entry.manifest)
        if need > self.host.budget:
            entry.fail(CapacityExhausted(
                f"adapter {entry.name} needs {need} bytes of host memory, more than the "
                f"whole host budget ({self.host.budget}); raise --host-cache-bytes"
            ))
            return False
        if not self.host.reserve(entries, entry, need):
            return False  # every byte is held by adapters in use: wait, retried at the next step
        entry.begin_fetch()
        self._fetches += 1
        return True

    def read_local(self, name: str, path: Path) -> tuple[AdapterWeights, AdapterManifest]:
        """Read and check the local PEFT directory ``path`` (blocking; without the lock)."""
        buffer = self.fetcher.read_local(name, path)
        assert buffer.manifest is not None
        weights = adapter_weights(buffer, self.config, self.max_rank, self.vocab_budget)
        return weights, buffer.manifest

    def keep_local(self, entries: Iterable[AdapterEntry], entry: AdapterEntry,
                   weights: AdapterWeights) -> None:
        """Keep ``weights``, read from a local directory, as ``entry``'s host copy (unless it
        has one), reserving their bytes outside the arena. Raises CapacityExhausted when the
        adapters in use leave no room. Call it with the manager's lock held."""
        if entry.weights is not None:
            return
        assert entry.manifest is not None
        need = host_nbytes(entry.manifest)
        if need > self.host.budget:
            raise CapacityExhausted(
                f"adapter {entry.name} needs {need} bytes of host memory, more than the "
                f"whole host budget ({self.host.budget}); raise --host-cache-bytes"
            )
        if not self.host.reserve(entries, entry, need, arena=False):
            raise CapacityExhausted(
                f"adapter {entry.name} needs {need} bytes of host memory; the host budget "
                f"({self.host.budget}) is held by adapters in use or pinned: retry later "
                "or raise --host-cache-bytes"
            )
        entry.land(weights, manifest_layers(entry.manifest))

    def fetch(self, entry: AdapterEntry, storage: torch.Tensor | None,
              on_layers: LayersCallback) -> AdapterWeights:
        """Stream ``entry`` from the store into ``storage`` (its arena range; None: allocate)
        and check it against the base model; ``on_layers(count)`` hears each time more of its
        leading layers landed verified. Raises the failure as a :class:`LorastreamError`.
        Call it without the lock."""
        try:
            started = time.perf_counter()
            timeline = entry.load
            if timeline is not None:
                timeline.fetch_began = started
            buffer = self.fetcher.fetch(entry.name, entry.adapter_id, storage, on_layers)
            elapsed = time.perf_counter() - started
            if timeline is not None:
                timeline.fetch_ended, timeline.fetch = started + elapsed, buffer.times
            self.metrics.fetch_seconds.observe(elapsed)
            self._cost_model.observe_fetch(entry.manifest.total_bytes, elapsed)
            self.metrics.host_landing_seconds.observe(buffer.landing_seconds)
            assert buffer.manifest is not None
            return adapter_weights(buffer, self.config, self.max_rank, self.vocab_budget)
        except LorastreamError:
            raise
        except Exception as err:
            log.exception("fetching %s failed", entry.name)
            raise SourceUnavailable(f"fetching adapter {entry.name} failed: {err!r}") from err

    def end(self, entry: AdapterEntry, landed: AdapterWeights | LorastreamError) -> None:
        """Record the end of ``entry``'s fetch: its checked weights (their bytes were reserved
        when the fetch began), or its error (the reservation is released). Call it with the
        manager's lock held."""
        if isinstance(landed, LorastreamError):
            self.fail(entry, landed)
        else:
            entry.land(landed, manifest_layers(entry.manifest))
        entry.end_fetch()
        self._fetches -= 1
        if entry.weights is None:
            self.host.drop(entry)  # release the reservation (layers_landed: 0)

    def fail(self, entry: AdapterEntry, err: LorastreamError) -> None:
        """``entry`` cannot be loaded: its requests fail with ``err`` (rule 5). Call it with
        the manager's lock held."""
        log.warning("adapter %s cannot be loaded: %s", entry.name, err)
        self.metrics.load_failures.inc()
        entry.fail(err)


_READ_CHUNK = 1 << 20


class AdapterFetcher:
    """Knows where adapters come from; owns the store client."""

    def __init__(self, device: Device, store: str | None, store_token: str | None = None,
                 process: FetchProcess | None = None, store_tls: ClientTLS | None = None) -> None:
        self._device = device
        self._store_target = store
        self._client = StoreClient(store, store_token, tls=store_tls) if store else None
        self._process = process
        self.chunk_bytes = 0  # stream chunk size asked of the store; 0: the store's default
        self.chunk_delay_s = 0.0  # test hook
        self._describes = 0  # DescribeAdapter calls in flight (request threads)
        self._describes_lock = threading.Lock()

    @property
    def has_store(self) -> bool:
        return self._client is not None

    @property
    def client(self) -> StoreClient | None:
        """The store client (the catalogue's watch shares its channel); None without a store."""
        return self._client

    @property
    def process(self) -> FetchProcess | None:
        return self._process

    @property
    def landing_memory(self) -> torch.Tensor | None:
        """Host memory the fetch process lands in (``[n]`` uint8): the host arena must be carved
        out of it for fetches to run there. None without a fetch process."""
        return None if self._process is None else self._process.memory.tensor

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
        if self._process is not None:
            self._process.close()

    def _store(self, name: str) -> StoreClient:
        if self._client is None:
            raise InvalidArgument(
                f"adapter {name!r} is not loaded on this worker and the worker has no store "
                "(start it with --store HOST:PORT, or LoadAdapter it from a local path)"
            )
        return self._client

    @property
    def describing(self) -> bool:
        """Whether a DescribeAdapter call is in flight: a request resolving an adapter this
        worker does not hold waits on the store (read without the lock: a hint for one gap)."""
        return self._describes > 0

    def describe(self, name: str) -> AdapterManifest:
        """The store's current manifest of ``name`` (its content id decides identity)."""
        client = self._store(name)
        with self._describes_lock:
            self._describes += 1
        try:
            return client.describe(name)
        finally:
            with self._describes_lock:
                self._describes -= 1

    def fetch(
        self, name: str, expected_id: str, storage: torch.Tensor | None = None,
        on_layers: LayersCallback | None = None,
    ) -> HostAdapterBuffer:
        """Stream ``name`` from the store into a host buffer, verified: into ``storage`` (a
        reserved host range, ``[>= nbytes]`` uint8) when given, else a new allocation. The
        stream names ``expected_id``'s version of ``name`` (``name@id``): it stays fetchable when
        the name moves on to other content meanwhile. ``on_layers(count)`` is called, before
        this returns, each time the count of leading layers landed and verified grows (layers
        per the manifest: ``layer_progress.manifest_layers``)."""
        ref = pinned_ref(name, expected_id)
        started = time.perf_counter()
        client = self._store(name)
        process = self._process
        if process is not None and storage is not None and process.memory.holds(storage):
            # The fetch process lands and verifies the bytes in ``storage``: shared memory.
            buffer = HostAdapterBuffer(self._device, storage)
            manifest, times = process.fetch(ref, storage, self.chunk_bytes, self.chunk_delay_s,
                                            on_layers)
            buffer.adopt(manifest, times.landing_s)
            buffer.times = times
        else:
            buffer = HostAdapterBuffer(self._device, storage, on_layers)
            sink = SlowSink(buffer, self.chunk_delay_s) if self.chunk_delay_s else buffer
            cpu = time.thread_time()
            manifest = client.stream_tensors(ref, sink, chunk_bytes=self.chunk_bytes)
            buffer.times.wall_s = time.perf_counter() - started
            buffer.times.cpu_s = time.thread_time() - cpu  # gRPC's own threads not counted
        if manifest.adapter_id != expected_id:
            raise SourceUnavailable(
                f"adapter {name} changed in the store while it was being fetched (now "
                f"{manifest.adapter_id[:12]}, expected {expected_id[:12]}); retry the request"
            )
        log.info(
            "fetched %s (%s, %.1f MB) from the store in %.3fs",
            name, expected_id[:12], manifest.total_bytes / 1e6, time.perf_counter() - started,
        )
        return buffer

    def read_local(self, name: str, path: Path) -> HostAdapterBuffer:
        """Validate a local PEFT directory and read its tensors into a new host buffer."""
        if not path.is_dir():
            raise InvalidArgument(f"{path} is not a directory; expected a PEFT LoRA directory")
        validated = validate_adapter_dir(path, label=f"{name} ({path})")
        manifest = validated.manifest(
            adapter_id=content_id(path), name=name, source_uri=path.resolve().as_uri(),
            created_at=time.time(),
        )
        buffer = HostAdapterBuffer(self._device)
        buffer.begin(manifest)
        fd = os.open(path / "adapter_model.safetensors", os.O_RDONLY)
        try:
            for index, staged in enumerate(validated.tensors):
                done = 0
                while done < staged.info.nbytes:
                    data = os.pread(
                        fd, min(_READ_CHUNK, staged.info.nbytes - done), staged.file_offset + done
                    )
                    if not data:
                        raise InvalidAdapter(f"{path}: weights file shrank while being read")
                    buffer.write(index, done, data)
                    done += len(data)
                info = staged.info
                if not verify_tensor(buffer.view(index), info.checksum, info.fast_checksum)[0]:
                    raise InvalidAdapter(f"{path}: weights changed while being read; retry")
                buffer.verified(index)
        finally:
            os.close(fd)
        return buffer


_Fetched = tuple[AdapterManifest, FetchTimes]  # the manifest landed, and where its time went


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
        return start if start >= 0 and start + view.numel() <= self.nbytes else None

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
        except Exception:
            log.exception("layers callback of fetch job %d failed", job)

    def close(self) -> None:
        with self.lock:
            self.alive = False
        with contextlib.suppress(OSError):  # already gone
            self._socket.shutdown(socket.SHUT_RDWR)  # the child sees EOF, and exits
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
        returns its manifest and where the fetch's time went. Blocks until done.

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
