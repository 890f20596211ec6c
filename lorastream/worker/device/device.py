"""The one module that knows whether we run on CUDA or on the CPU.

Everything above it (slot pool, adapter loader, scheduler) calls only this layer, so the same
scheduling code runs — and is tested — on CPU-only machines.

On CUDA:
  * host buffers are pinned (page-locked), so host→device copies can be asynchronous;
  * a dedicated *load stream* runs adapter copies while the compute stream keeps decoding;
  * an :class:`Event` is a ``torch.cuda.Event`` recorded on a stream; ``query()`` never blocks.

On the CPU (every machine here):
  * host buffers are plain tensors (``pin_memory`` raises on the CPU build of torch);
  * the load stream is ONE dedicated copy thread that runs submitted copies in submission order,
    in turns between the decode steps
    (:class:`~lorastream.worker.device.cpu.step_gate.StepGate` says why; the engine runs each step
    inside :meth:`Device.step`);
  * an :class:`Event` is a host-side completion flag with the same ``query``/``wait`` calls.

A test hook (:attr:`LoadStream.copy_delay_s`) slows every copy so races become observable.

On the CPU the loader threads compete with the step's matmul threads for the same cores (on a GPU
they would not: copies are DMA); how they share them is the CPU tuning of ``cpu/`` (thread
priorities and counts in ``cpu/threads.py``, turns between steps in ``cpu/step_gate.py``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from lorastream.worker.device.cpu.binding import bind_team, unbind_team
from lorastream.worker.device.cpu.step_gate import CopyTurn, StepGate
from lorastream.worker.device.cpu.threads import loader_thread_init, use_intra_op_threads

log = logging.getLogger(__name__)


class Event:
    """Completion of work on a stream. ``query`` never blocks; ``wait`` blocks the host."""

    def query(self) -> bool:
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> bool:
        raise NotImplementedError


class HostEvent(Event):
    """A host-side completion flag (the CPU stand-in for ``torch.cuda.Event``)."""

    def __init__(self, done: bool = False) -> None:
        self._flag = threading.Event()
        self.error: BaseException | None = None
        if done:
            self._flag.set()

    def set(self, error: BaseException | None = None) -> None:
        self.error = error
        self._flag.set()

    def query(self) -> bool:
        return self._flag.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._flag.wait(timeout)


class CudaEvent(Event):  # pragma: no cover - needs a GPU
    def __init__(self, stream: torch.cuda.Stream) -> None:
        self._event = torch.cuda.Event()
        self._event.record(stream)
        self.error: BaseException | None = None

    @property
    def raw(self) -> torch.cuda.Event:
        return self._event

    def query(self) -> bool:
        return self._event.query()

    def wait(self, timeout: float | None = None) -> bool:
        self._event.synchronize()
        return True


COMPLETED = HostEvent(done=True)
COPY_TURN_S = 0.020  # the CPU load stream's copy time between two steps (see cpu/step_gate.py)
FETCH_TURN_S = 0.0  # on the CPU, each gap held open this long while a fetch is in flight
LOAD_SHARE = 0.3  # on the CPU, the wall time left to loaders while a cold request waits


CopyOps = Sequence[Callable[[], None]]  # operations that issue copies, run in order


@dataclass
class _Job:
    ops: CopyOps
    after: Event | None
    done: HostEvent = field(default_factory=HostEvent)


class LoadStream:
    """Runs adapter copies off the compute path, in submission order.

    ``submit(ops, after=ev)`` enqueues ``ops`` (callables that issue copies) to run in order once
    ``ev`` completed, and returns an event that completes when their copies have landed.
    ``after`` is how rule 2 of docs/design.md is kept: a slot is overwritten only after the last
    step that read it finished. On the CPU the operations run in turns of ``gate`` between steps.
    """

    def __init__(
        self, device: torch.device, loader_priority: str = "nice:0", gate: StepGate | None = None
    ) -> None:
        self.device = device
        self.loader_priority = loader_priority
        self.gate = gate or StepGate(0.0)
        self.copy_delay_s = 0.0  # test hook: sleep this long before every copy job
        self._cuda = device.type == "cuda"
        if self._cuda:  # pragma: no cover - needs a GPU
            self._stream = torch.cuda.Stream(device=device)
        else:
            self._jobs: queue.Queue[_Job | None] = queue.Queue()
            self._thread = threading.Thread(target=self._run, name="load-stream", daemon=True)
            self._thread.start()

    @property
    def thread_id(self) -> int | None:
        """The copy thread's native id on the CPU; None on CUDA, where there is no thread."""
        return None if self._cuda else self._thread.native_id

    def submit(self, ops: CopyOps, after: Event | None = None) -> Event:
        if self._cuda:  # pragma: no cover - needs a GPU
            if self.copy_delay_s:
                time.sleep(self.copy_delay_s)
            with torch.cuda.stream(self._stream):
                if isinstance(after, CudaEvent):
                    self._stream.wait_event(after.raw)
                for op in ops:
                    op()
                return CudaEvent(self._stream)
        job = _Job(ops, after)
        self._jobs.put(job)
        return job.done

    def _run(self) -> None:
        loader_thread_init(self.loader_priority)
        turn = CopyTurn(self.gate)
        while True:
            try:  # a job queued behind the one just copied goes on in the same turn
                job = self._jobs.get_nowait() if turn.open else self._jobs.get()
            except queue.Empty:
                turn.end()
                continue
            if job is None:
                break
            try:
                if job.after is not None and not job.after.query():
                    turn.end()  # never hold a turn (and the steps) while waiting on a step
                    job.after.wait()
                if self.copy_delay_s:
                    turn.end()
                    time.sleep(self.copy_delay_s)
                for op in job.ops:
                    turn.before_op()
                    op()
                job.done.set()  # inside the turn: an engine waiting for it sees the copy done
            except BaseException as exc:
                log.exception("copy on the load stream failed")
                job.done.set(exc)
        turn.end()

    def close(self) -> None:
        if not self._cuda:
            self._jobs.put(None)
            self._thread.join(timeout=5)


class Device:
    """Buffers, streams and events for one device."""

    def __init__(
        self,
        device: str | torch.device = "cpu",
        loader_priority: str = "nice:0",
        copy_turn_s: float = COPY_TURN_S,
        bind_compute: bool = True,
        fetch_turn_s: float = FETCH_TURN_S,
        load_share: float = LOAD_SHARE,
    ) -> None:
        self.device = torch.device(device)
        self.bind_compute = bind_compute  # on the CPU: compute threads one per core
        self.is_cuda = self.device.type == "cuda"
        self.loader_priority = loader_priority  # of loader threads (fetch, CPU copies)
        # CPU copies take turns with the steps; CUDA copies are DMA beside them (no gate)
        self.gate = StepGate(0.0 if self.is_cuda else copy_turn_s)
        # CPU fetches get the cores between steps; CUDA's loaders have host cores of their own
        self.fetch_turn_s = 0.0 if self.is_cuda else fetch_turn_s
        # CPU loaders get a share of the cores while a cold request waits for them (step_gate.py)
        self.load_share = 0.0 if self.is_cuda else load_share
        self.load_stream = LoadStream(self.device, loader_priority, self.gate)

    @contextmanager
    def step(self) -> Iterator[None]:
        """Run one step's compute: on the CPU, copies of the load stream wait for its end."""
        with self.gate.step():
            yield

    def between_steps(self, fetching: bool = False, cold_waiting: bool = False,
                      arrived_ready: bool = False) -> None:
        """Before the next step is scheduled, on the CPU: while ``fetching`` (a store fetch, or
        a cold adapter's DescribeAdapter, is in flight and sequences run), leave the cores to
        the idle-priority loaders for ``fetch_turn_s``; while ``cold_waiting`` too (a request
        waits for that fetch or that manifest), for
        ``load_share`` of the wall time; then a copy of the load stream waiting for this gap
        copies now (one turn), so what it loads can join that step (``cpu/step_gate.py``).
        ``arrived_ready``: requests that need no load arrived since the last step: the share's
        hold gives way to their prefill this once (``StepGate.hold_share``'s ``defer``)."""
        if fetching and cold_waiting and self.load_share > 0:
            self.gate.hold_share(self.load_share, defer=arrived_ready)
        else:
            self.gate.forgive()
            if fetching and self.fetch_turn_s > 0:
                self.gate.hold_gap(self.fetch_turn_s)
        self.gate.give_turn()

    def use_compute_threads(self, count: int) -> dict[int, int] | None:
        """Make the calling thread the one that computes, on ``count`` intra-op threads; on the
        CPU, bind them one per core (``cpu/binding.py`` says why and when). Returns
        ``{thread id: cpu}`` of the bound threads, None if not bound."""
        use_intra_op_threads(count)
        if self.is_cuda or not self.bind_compute:
            return None
        return bind_team(count)

    def release_compute_threads(self, bound: dict[int, int] | None) -> None:
        """Undo :meth:`use_compute_threads`' binding (the engine's loop ended)."""
        if bound:
            unbind_team(bound)

    def host_empty(self, shape: tuple[int, ...] | int, dtype: torch.dtype) -> torch.Tensor:
        """A host staging buffer: pinned on CUDA (async H2D copies), plain on the CPU."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.is_cuda)

    def pin_host(self, tensor: torch.Tensor) -> None:
        """Page-lock host memory allocated elsewhere (a shared mapping), in place: on CUDA
        (``cudaHostRegister``) so copies from it are asynchronous; nothing to do on the CPU."""
        if self.is_cuda:  # pragma: no cover - needs a GPU
            nbytes = tensor.numel() * tensor.element_size()
            error = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
            if int(error) != 0:
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {error}")

    def record_compute(self) -> Event:
        """An event that completes when the work enqueued so far on the compute stream is done.

        On the CPU a step has finished when the step call returns, so this is already complete.
        """
        if self.is_cuda:  # pragma: no cover - needs a GPU
            return CudaEvent(torch.cuda.current_stream(self.device))
        return COMPLETED

    def compute_wait(self, event: Event) -> None:
        """Make the compute stream wait for ``event`` (never a device-wide synchronize)."""
        if self.is_cuda and isinstance(event, CudaEvent):  # pragma: no cover - needs a GPU
            torch.cuda.current_stream(self.device).wait_event(event.raw)
        elif not event.query():
            # The scheduler only uses a slot whose event query()'d complete, so this is a bug.
            raise RuntimeError("a step would read a device slot whose load has not completed")

    def close(self) -> None:
        self.load_stream.close()


def host_reads_stall(device: torch.device) -> bool:
    """True where reading a tensor back to the host waits for the device's queued work (CUDA):
    step code then takes its sync-free variant. On the CPU a read costs nothing extra, so code
    that reads to skip work (the sampler's adaptive top-p) keeps doing so."""
    return device.type == "cuda"
