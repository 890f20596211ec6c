"""The engine wires model, KV cache, LoRA slots, adapter manager, scheduler and sampler together.

Request threads call :meth:`Engine.submit` (validation, tokenization and the adapter lookup
happen there, off the step loop, in :mod:`~lorastream.worker.engine.intake`) and read events from
the returned :class:`RequestStream`. One engine thread runs the loop: take new requests and
cancellations, schedule, run one forward step for the whole mixed batch, sample (in
:mod:`~lorastream.worker.engine.step_sampling`), stream tokens, retire finished sequences.

The loop runs either on a thread of its own (:meth:`Engine.start`) or on the calling thread
(:meth:`Engine.run`, :meth:`Engine.run_while`). The worker process and ``bench engine`` use the
latter on the main thread, the one that loaded the model: on the CPU, torch's OpenMP pool of
that thread is then the only multi-threaded one in the process (see
:func:`~lorastream.worker.device.cpu.threads.use_intra_op_threads`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar, cast

import torch

from lorastream.core.adapter_mix import MixSpec, parse_mix_model
from lorastream.core.errors import InvalidArgument, LorastreamError, SourceUnavailable
from lorastream.core.generation import FinishReason, GenerationEvent, PromptInput, TokenLogprobs
from lorastream.worker.device.cpu.threads import use_one_intra_op_thread
from lorastream.worker.device.device import Device
from lorastream.worker.device.step_arena import StepStaging
from lorastream.worker.engine.choices import fork_choices
from lorastream.worker.engine.detokenizer import Tokenizer
from lorastream.worker.engine.intake import RequestIntake
from lorastream.worker.engine.layered_prefill import LayeredPrefills
from lorastream.worker.engine.logits_processors import token_logprobs
from lorastream.worker.engine.prefix_cache import PrefixCache
from lorastream.worker.engine.sampling import Sampler, SamplingParams
from lorastream.worker.engine.scheduler import Scheduler
from lorastream.worker.engine.sequence import RequestStream, Sequence
from lorastream.worker.engine.step_inputs import StepPlan, build_step_inputs
from lorastream.worker.engine.step_sampling import sample_step
from lorastream.worker.engine.token_outcome import take_token
from lorastream.worker.loading.manager import AdapterManager
from lorastream.worker.loading.tokenizers import AdapterTokenizer
from lorastream.worker.lora.backend import LoraBackend, LoraStep, staged_size
from lorastream.worker.lora.slots import LoraSlots
from lorastream.worker.metrics import TierState
from lorastream.worker.model.decoder import DecoderModel
from lorastream.worker.model.kv_cache import BLOCK_SIZE, KVCache

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class EngineStats:
    generated_tokens: int = 0
    finished_requests: int = 0
    steps: int = 0
    step_seconds: float = 0.0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    peak_running: int = 0
    started: float = field(default_factory=time.perf_counter)


class Engine:
    def __init__(
        self,
        model: DecoderModel,
        tokenizer: Tokenizer,
        kv: KVCache,
        slots: LoraSlots,
        adapters: AdapterManager,
        backend: LoraBackend,
        device: Device,
        *,
        base_model_name: str,
        max_batch_size: int,
        max_num_tokens: int,
        max_seq_len: int,
        default_max_tokens: int,
        prefetch_depth: int = 8,
        prefix_caching: bool = True,
        max_mix_adapters: int = 4,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.kv = kv
        self.slots = slots
        self.adapters = adapters
        self.backend = backend
        self.device = device
        self.base_model_name = base_model_name
        # a weighted mix's most components: the setting, and never more than the slots
        self.max_mix_adapters = min(max_mix_adapters, slots.num_slots)
        self.prefix = PrefixCache(
            kv.allocator, model.config, enabled=prefix_caching, base_identity=base_model_name,
            quantization=model.quantization,
        )
        self._reset_prefix = threading.Event()  # the operator asked; the loop does it
        # layer-ordered admission (--layered-admission): held only when the adapters fill
        # slots layer by layer, else None
        self.layered = LayeredPrefills(
            model, kv, slots, backend, adapters, max_num_tokens
        ) if adapters.layered else None
        self.scheduler = Scheduler(
            kv.allocator,
            adapters,
            max_batch_size=max_batch_size,
            max_num_tokens=max_num_tokens,
            prefetch_depth=prefetch_depth if adapters.overlap else 0,
            layered=self.layered,
            prefix=self.prefix,
        )
        self.sampler = Sampler()
        self.staging = StepStaging(device, capacity=16 * max_num_tokens + 4096)
        self.intake = RequestIntake(
            tokenizer, model.config, max_seq_len=max_seq_len, kv_blocks=kv.num_blocks,
            default_max_tokens=default_max_tokens,
        )
        self.stats = EngineStats()
        adapters.metrics.watch(self.metrics_state)
        self._inbox: queue.SimpleQueue[Sequence] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._submit_lock = threading.Lock()  # submit vs stop: nothing queued after the drain
        # The loop computes with the intra-op thread count of the thread that built the engine.
        self.compute_threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self.run, name="engine", daemon=True)
        self._loop_thread: threading.Thread | None = None  # set when the loop starts running
        self.bound_threads: dict[int, int] | None = None  # compute thread -> its core, if bound
        self._loop_done = threading.Event()
        self._wind_down_lock = threading.Lock()
        self._wound_down = False

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> Engine:
        """Run the loop on a thread of its own."""
        self._thread.start()
        return self

    def run(self) -> None:
        """Run the loop on the calling thread until :meth:`stop` is called (from another thread
        or a signal handler), then wind down: requests still in flight end with UNAVAILABLE."""
        self._loop()
        self._wind_down()

    def run_while(self, work: Callable[[], T]) -> T:
        """Run ``work`` on a helper thread and the loop on this one; stop the engine when ``work``
        returns or raises, and return its result (or raise its exception)."""
        outcome: list[T] = []
        failure: list[BaseException] = []

        def drive() -> None:
            try:
                use_one_intra_op_thread()  # the loop's thread keeps the one multi-threaded pool
                outcome.append(work())
            except BaseException as exc:
                failure.append(exc)
            finally:
                self.stop()

        driver = threading.Thread(target=drive, name="engine-driver", daemon=True)
        driver.start()
        self.run()
        driver.join()
        if failure:
            raise failure[0]
        return outcome[0]

    @property
    def started(self) -> bool:
        running = self._loop_thread is not None and not self._loop_done.is_set()
        return self._thread.is_alive() or running

    def stop(self) -> None:
        """Stop the loop; requests still queued or running end with UNAVAILABLE (never hang).

        Called on the loop's own thread (a signal handler while :meth:`run` runs), it only asks
        the loop to end; :meth:`run` winds down when the loop has ended."""
        with self._submit_lock:
            self._stop.set()
        self._wake.set()
        if threading.current_thread() is self._loop_thread:
            return
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        elif self._loop_thread is not None:
            self._loop_done.wait(timeout=30)
        self._wind_down()

    def _wind_down(self) -> None:
        """Fail what is left and release loaders and streams, once, after the loop ended."""
        with self._wind_down_lock:
            if self._wound_down:
                return
            if self._loop_thread is not None and not self._loop_done.is_set():
                log.error("the engine loop did not stop within 30 s; requests in flight are left")
            else:  # the loop is gone: its state is ours to wind down
                self._intake()
                gone = SourceUnavailable("the worker is shutting down; retry the request")
                for seq in self._admitted_or_waiting():
                    self._fail(seq, gone)
            self._wound_down = True
            self.adapters.close()
            self.device.close()

    def healthy_after_stop(self) -> bool:
        """No leaked KV blocks or adapter references once no request is left (a test check)."""
        if self.scheduler.has_work or not self._inbox.empty():
            return True  # stopped with requests in flight: nothing to conclude
        refs = self.adapters.usage().references
        return refs == 0 and self.kv.allocator.used_blocks == 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (operator API): the loop does it before it next admits,
        so any request submitted after this call reuses nothing cached before it."""
        self._reset_prefix.set()
        self._wake.set()

    def is_base_model(self, name: str) -> bool:
        return name in ("", self.base_model_name)

    # -- intake (request threads) -------------------------------------------------------------
    def tokenize(self, prompt: PromptInput) -> list[int]:
        return self.intake.tokenize(prompt)

    def _tokenizer_of(self, adapter_id: str) -> AdapterTokenizer | None:
        return self.adapters.tokenizer(adapter_id)

    def tokenizer_for(self, model: str) -> Tokenizer:
        """The tokenizer ``model``'s requests use: an adapter's own if it ships one, else the
        base model's. Raises AdapterNotFound for a name no adapter has, as a request would."""
        if self.is_base_model(model):
            return self.tokenizer
        own = self._tokenizer_of(self.adapters.resolve(model))
        return self.tokenizer if own is None else cast(Tokenizer, own.tokenizer)

    def submit(
        self,
        model: str,
        prompt: PromptInput,
        params: SamplingParams,
        request_id: str | None = None,
        mix: MixSpec = (),
    ) -> RequestStream:
        """Validate and queue a request; raises domain errors for bad input (nothing queued).
        ``mix``: a weighted mix's (adapter name, weight) per component, which ``model`` may
        spell instead (``mix:a=0.7,b=0.3``, ``core/adapter_mix.py``)."""
        components = mix or parse_mix_model(model)
        seq = self.intake.sequence(
            prompt, params,
            lambda: None if self.is_base_model(model) else self.adapters.resolve(model),
            request_id, self.adapters.invocation_tokens, self._tokenizer_of,
            None if not components else (
                lambda: self.adapters.resolve_mix(components, self.max_mix_adapters)),
        )
        with self._submit_lock:
            if self._stop.is_set():
                raise SourceUnavailable("the worker is shutting down; retry the request")
            self._acquire(seq)  # with overlap, its fetches start now, not at a step
            self._inbox.put(seq)
        self._wake.set()
        return seq.stream

    def _acquire(self, seq: Sequence) -> None:
        """A reference on every adapter ``seq`` needs; none held if one fails."""
        taken: list[str] = []
        try:
            for adapter_id in seq.adapter_ids:
                self.adapters.acquire(adapter_id)
                taken.append(adapter_id)
        except LorastreamError:
            self._release(taken)
            raise

    def _release(self, adapter_ids: tuple[str, ...] | list[str]) -> None:
        for adapter_id in adapter_ids:
            self.adapters.release(adapter_id)

    # -- the loop -----------------------------------------------------------------------------
    def _loop(self) -> None:
        self._loop_thread = threading.current_thread()
        try:
            self.bound_threads = self.device.use_compute_threads(self.compute_threads)
            self._loop_steps()
        finally:
            self.device.release_compute_threads(self.bound_threads)
            self._loop_done.set()

    def _loop_steps(self) -> None:
        while not self._stop.is_set():
            try:
                arrived = self._intake()
                self._drop_cancelled()
                if self._reset_prefix.is_set():
                    self._reset_prefix.clear()
                    self.prefix.reset()
                # a fetch in flight gets the cores for a moment (its share while a request
                # waits for it, or for its adapter's manifest); then a slot copy ready since
                # the last step lands (both on the CPU only; step_gate.py)
                running = bool(self.scheduler.running)
                fetching = running and self.adapters.fetching
                resolving = running and self.adapters.resolving
                cold_waiting = resolving or (
                    fetching and self.scheduler.waiting_on_loads() > 0)
                # ... which gives way to the prefill of arrivals that need no load
                arrived_ready = cold_waiting and any(
                    not self.scheduler.needs_load(seq) for seq in arrived)
                self.device.between_steps(fetching or resolving, cold_waiting, arrived_ready)
                plan = self.scheduler.schedule()
                for seq, err in plan.failed:
                    self._fail(seq, err)
                # layered admission: prefills whose adapter still lands run its landed layers
                if self.layered is not None and self.layered.sequences:
                    with self.device.step():
                        for seq, err in self.layered.advance():
                            self._fail(seq, err)
                if plan.empty:
                    # Idle, or waiting on loads: poll loads every millisecond, else sleep.
                    timeout = 0.001 if self.scheduler.has_work else None
                    self._wake.wait(timeout)
                    self._wake.clear()
                    continue
                with self.device.step():  # on the CPU, slot copies wait for its end
                    self._step(plan)
            except Exception:
                log.exception("engine step failed; failing the running requests")
                for seq in [*self.scheduler.running, *self.scheduler.landing]:
                    self._fail(seq, LorastreamError("internal error in the engine step"))

    def _intake(self) -> list[Sequence]:
        """Queue the requests submitted since the last look; returns them."""
        arrived: list[Sequence] = []
        while True:
            try:
                seq = self._inbox.get_nowait()
            except queue.Empty:
                return arrived
            self.scheduler.add(seq)
            arrived.append(seq)

    def _admitted_or_waiting(self) -> list[Sequence]:
        s = self.scheduler
        return [*s.waiting, *s.running, *s.landing]

    def _drop_cancelled(self) -> None:
        for seq in self._admitted_or_waiting():
            if seq.cancelled:
                self._retire(seq, FinishReason.CANCELLED, (), "")

    def _step(self, plan: StepPlan) -> None:
        started = time.perf_counter()
        sequences = plan.sequences
        wanted = [seq.adapter_ids or (None,) for seq in sequences]  # a mix: each component
        adapters = self.adapters.prepare_step([a for ids in wanted for a in ids])
        placed = iter(adapters.slots)
        for seq, ids in zip(sequences, wanted, strict=True):
            seq.place([next(placed) for _ in ids])
        for event in adapters.load_events:  # rule 1: compute waits for the slot's copy
            self.device.compute_wait(event)
        rows = sum(1 for _ in plan.decode) + sum(chunk for _, chunk in plan.prefill)
        units = rows + sum(  # LoRA units: a mix row is one per component
            (len(seq.mix) - 1) * count for seq, count in
            [*((seq, 1) for seq in plan.decode), *plan.prefill] if seq.mix
        )
        inputs = build_step_inputs(plan, self.staging, extra=staged_size(
            units, self.slots.num_slots, self.slots.token_width))
        batch = inputs.batch
        lora = LoraStep.for_step(self.slots, self.backend, inputs.token_slots, self.model.dtype,
                                 self.model.device, inputs.arena, inputs.logit_rows)
        assert inputs.arena is not None
        inputs.arena.flush()  # rule 3: one non-blocking copy of the step's metadata
        logits = self.model.forward(batch, self.kv, lora)  # [n, V]
        self.adapters.mark_read(adapters, self.device.record_compute())  # rule 2
        drawn = sample_step(
            self.sampler, logits, inputs.samplers, self._fork, lambda: self.intake.masks
        )
        for seq, count in inputs.fed:
            seq.num_computed += count
        for i, (seq, token) in enumerate(zip(drawn.sequences, drawn.tokens, strict=True)):
            decode = seq.detokenizer.tokenizer.decode  # the adapter's own, or the base model's
            self._emit(seq, int(token), token_logprobs(int(token), drawn.logprobs.get(i), decode))
        self.adapters.observe_step(rows, time.perf_counter() - started)
        self.stats.steps += 1
        self.stats.peak_running = max(self.stats.peak_running, len(self.scheduler.running))
        self.stats.step_seconds += time.perf_counter() - started
        self.stats.decode_tokens += len(plan.decode)
        self.stats.prefill_tokens += sum(chunk for _, chunk in plan.prefill)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Choices 1 .. n-1 of a request whose prompt was just prefilled, now running."""
        children = fork_choices(parent, self.kv, parent.detokenizer.tokenizer)
        self.prefix.forked(parent, children)
        for child in children:
            self._acquire(child)
        self.scheduler.running.extend(children)
        return children

    def _emit(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None = None) -> None:
        try:
            reason, text = take_token(seq, token)
        except InvalidArgument as err:  # a bug: never hand out off-grammar output
            log.error("request %s: %s", seq.request_id, err)
            self._fail(seq, LorastreamError(f"internal error: {err}"))
            return
        self.stats.generated_tokens += 1
        lps = (logprobs,) if logprobs is not None else ()
        if reason is None:
            seq.stream.put(GenerationEvent(
                (token,), text, len(seq.prompt_ids), len(seq.output_ids), logprobs=lps,
                index=seq.choice, cached_tokens=seq.cached_tokens,
            ))
        else:
            self._retire(seq, reason, (token,), text, lps)

    def _retire(
        self, seq: Sequence, reason: FinishReason, tokens: tuple[int, ...], text: str,
        logprobs: tuple[TokenLogprobs, ...] = (),
    ) -> None:
        self.scheduler.finish(seq)
        self._release(seq.adapter_ids)
        seq.stream.put(GenerationEvent(
            tokens, text, len(seq.prompt_ids), len(seq.output_ids), reason, logprobs,
            seq.choice, seq.cached_tokens,
        ))
        seq.finished = True
        if seq.group is None or seq.group.retire(seq):  # the request's last choice ended
            self.stats.finished_requests += 1
            seq.stream.put(None)

    def _fail(self, seq: Sequence, err: LorastreamError) -> None:
        """End the request with ``err``: every choice of it still running goes too."""
        if seq.finished:
            return
        for member in seq.group.members if seq.group is not None else [seq]:
            if not member.finished:
                member.finished = True
                self.scheduler.finish(member)
                self._release(member.adapter_ids)
        seq.stream.put(err)

    # -- introspection ------------------------------------------------------------------------
    def metrics_state(self) -> TierState:
        """What the Prometheus collector reports at scrape time."""
        usage = self.adapters.usage()
        statuses = self.adapters.statuses()  # one per name: the names requests ask by
        return TierState(
            resident=usage.resident,
            resident_bytes=usage.resident_bytes,
            waiting_on_load=self.scheduler.waiting_on_loads(),
            waiting=self.waiting,
            running=self.running,
            kv_tokens_used=self.kv.allocator.used_blocks * BLOCK_SIZE,
            prefix_cached_blocks=self.kv.allocator.cached_blocks,
            prefix_hit_rate=self.prefix.stats.hit_rate,
            ready_adapters=tuple(sorted({s.name for s in statuses if s.residency == "device"})),
            held_adapters=tuple(sorted({
                s.name for s in statuses if s.residency in ("device", "host")
            })),
            wanted_adapters=tuple(sorted({
                s.name for s in statuses if s.references > 0 and s.residency != "device"
            })),
            adapter_slots=self.slots.num_slots,
            slot_bytes={"projections": self.slots.nbytes - self.slots.expert_nbytes,
                        "experts": self.slots.expert_nbytes},
            kv_blocks=self.kv.num_blocks,
            kv_blocks_used=self.kv.allocator.used_blocks,
            kv_block_size=BLOCK_SIZE,
        )

    @property
    def waiting(self) -> int:
        return len(self.scheduler.waiting) + self._inbox.qsize()

    @property
    def running(self) -> int:
        return len(self.scheduler.running)

