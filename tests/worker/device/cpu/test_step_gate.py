"""On the CPU the load stream copies between decode steps, never during one (``step_gate.py``):
steps and copy turns never overlap, each gap between steps holds at most one turn of about
``turn_s``, a copy makes progress while steps run back to back, and an idle engine does not hold
copies up."""

from __future__ import annotations

import itertools
import threading
import time

import torch

from lorastream.core.generation import PromptInput, SamplingParams
from lorastream.worker.device.cpu.step_gate import StepGate
from lorastream.worker.device.device import Device, LoadStream
from tests.worker.conftest import PROMPTS, EngineFactory, StoreStack, busy, greedy_tokens

Interval = tuple[float, float]


class _Recorder:
    """Intervals of steps and of copy operations, by the clock."""

    def __init__(self) -> None:
        self.steps: list[Interval] = []
        self.ops: list[Interval] = []

    def op(self, seconds: float) -> None:
        began = time.perf_counter()
        busy(seconds)
        self.ops.append((began, time.perf_counter()))


def _overlap(a: Interval, b: Interval) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _steps(gate: StepGate, record: _Recorder, count: int, seconds: float) -> None:
    for _ in range(count):
        with gate.step():
            began = time.perf_counter()
            busy(seconds)
            record.steps.append((began, time.perf_counter()))


def test_copies_run_between_steps_one_turn_per_gap_and_progress_while_steps_run() -> None:
    # idle_s is long here: a stepper thread that the OS or the GIL keeps off the CPU for a few ms
    # between two steps must not look like an idle engine (which gets turns back to back, see
    # test_an_idle_engine_does_not_hold_copies_up); this test is about back-to-back steps.
    gate = StepGate(turn_s=0.004, idle_s=1.0)
    stream = LoadStream(torch.device("cpu"), gate=gate)
    record = _Recorder()
    try:
        done = stream.submit([lambda: record.op(0.001) for _ in range(40)])
        _steps(gate, record, count=60, seconds=0.005)  # back to back, as a busy engine steps
        assert done.wait(5) and done.error is None
    finally:
        stream.close()
    assert len(record.ops) == 40
    assert not [(s, o) for s in record.steps for o in record.ops if _overlap(s, o)]
    # Each gap between two steps holds at most one turn: ~4 ms, i.e. at most 5 of the 1 ms ops.
    for before, after in itertools.pairwise(record.steps):
        in_gap = [o for o in record.ops if before[1] <= o[0] and o[1] <= after[0]]
        assert len(in_gap) <= 5, f"{len(in_gap)} copy operations ran in one gap"
    finished = max(end for _, end in record.ops)
    steps_before = sum(1 for _, end in record.steps if end <= finished)
    # 10 turns of 4 ops are needed; a preempted op makes its turn end early, so allow slack, but
    # the copy must finish well within the 60 back-to-back steps (without turns it never would).
    assert steps_before <= 30, f"the copy took {steps_before} steps (10 turns of 4 ops needed)"


def test_small_jobs_queued_back_to_back_share_a_turn() -> None:
    """40 jobs of one short operation each (an adapter copied layer by layer) take a few turns
    of ``turn_s``, not one gap between steps each; steps and copies still never overlap."""
    gate = StepGate(turn_s=0.004, idle_s=1.0)
    stream = LoadStream(torch.device("cpu"), gate=gate)
    record = _Recorder()
    try:
        with gate.step():  # the jobs queue up during a step, as layers land during one
            events = [stream.submit([lambda: record.op(0.0005)]) for _ in range(40)]
            busy(0.005)
        _steps(gate, record, count=30, seconds=0.005)
        assert all(e.wait(5) and e.error is None for e in events)
    finally:
        stream.close()
    assert len(record.ops) == 40
    assert gate.turns <= 12  # 40 x 0.5 ms in turns of 4 ms (one op past the budget at most)
    assert not [(s, o) for s in record.steps for o in record.ops if _overlap(s, o)]


def test_an_idle_engine_does_not_hold_copies_up() -> None:
    gate = StepGate(turn_s=0.002)
    stream = LoadStream(torch.device("cpu"), gate=gate)
    record = _Recorder()
    try:
        _steps(gate, record, count=1, seconds=0.001)  # then no step: the engine waits for work
        began = time.perf_counter()
        done = stream.submit([lambda: record.op(0.001) for _ in range(50)])
        assert done.wait(5)
        took = time.perf_counter() - began
    finally:
        stream.close()
    assert took < 0.5, f"50 ms of copies took {took:.3f} s with no step to wait for"


def test_a_step_waits_for_the_turn_in_progress_only() -> None:
    gate = StepGate(turn_s=0.05)
    entered, release = threading.Event(), threading.Event()

    def copier() -> None:
        gate.begin_turn()
        entered.set()
        release.wait(5)
        gate.end_turn()

    thread = threading.Thread(target=copier)
    thread.start()
    assert entered.wait(5)
    stepped = threading.Event()

    def step() -> None:
        with gate.step():
            stepped.set()

    stepper = threading.Thread(target=step)
    stepper.start()
    assert not stepped.wait(0.1)  # a turn is in progress: the step waits for it
    release.set()
    assert stepped.wait(5)
    thread.join(5)
    stepper.join(5)


def test_with_turns_off_copies_run_beside_steps() -> None:
    gate = StepGate(0.0)
    stream = LoadStream(torch.device("cpu"), gate=gate)
    record = _Recorder()
    try:
        with gate.step():  # a step that never ends while the copy runs
            done = stream.submit([lambda: record.op(0.001) for _ in range(5)])
            assert done.wait(5), "with turns off a copy must not wait for the step"
    finally:
        stream.close()
    assert len(record.ops) == 5 and gate.turns == 0


def test_cuda_devices_have_no_gate_and_cpu_devices_take_the_setting() -> None:
    device = Device("cpu", copy_turn_s=0.003)
    try:
        assert device.gate.enabled and device.gate.turn_s == 0.003
        assert device.load_stream.gate is device.gate
    finally:
        device.close()


def test_the_engine_copies_adapters_into_slots_only_between_its_steps(
    engine_factory: EngineFactory, store: StoreStack, reference: dict[tuple[str, int], list[int]]
) -> None:
    engine = engine_factory(store=store.target, start=False, max_loras=2, copy_turn_ms=1.0)
    record = _Recorder()
    step, write_ops = engine._step, engine.slots.write_ops

    def timed_step(plan: object) -> None:
        began = time.perf_counter()
        step(plan)  # type: ignore[arg-type]  # a timing wrapper around the method
        record.steps.append((began, time.perf_counter()))

    def timed(op: object) -> object:
        def run() -> None:
            began = time.perf_counter()
            op()  # type: ignore[operator]  # a timing wrapper around the method
            record.ops.append((began, time.perf_counter()))
        return run

    engine._step = timed_step  # type: ignore[method-assign]  # a timing wrapper around the method
    def timed_ops(*args: object, **kwargs: object) -> list[object]:
        return [timed(op) for op in write_ops(*args, **kwargs)]  # type: ignore[arg-type]  # a timing wrapper around the method

    engine.slots.write_ops = timed_ops  # type: ignore[method-assign]  # a timing wrapper around the method
    engine.start()
    running = engine.submit("tiny", PromptInput(token_ids=tuple(PROMPTS[0])),
                            SamplingParams(max_tokens=300, ignore_eos=True))
    next(running)
    for name in ("all-r64", "attn-r4", "mlp-r8"):  # 2 slots: the third evicts the first
        assert greedy_tokens(engine, name, 1) == reference[(name, 1)]
    assert len([t for event in running for t in event.token_ids]) > 100  # it kept decoding
    assert record.ops and record.steps
    assert not [(s, o) for s in record.steps for o in record.ops if _overlap(s, o)]
    assert engine.device.gate.turns > 0


def test_a_copy_ready_during_a_step_lands_before_the_next_step_is_scheduled() -> None:
    gate = StepGate(turn_s=0.02)
    stream = LoadStream(torch.device("cpu"), gate=gate)
    try:
        with gate.step():
            done = stream.submit([lambda: busy(0.002) for _ in range(3)])
            deadline = time.monotonic() + 10  # until the copy thread waits for the gap
            while not gate._turn_waiting and time.monotonic() < deadline:
                time.sleep(0.001)
            assert gate._turn_waiting and not done.query()
        gate.give_turn()  # the engine, before it schedules the next step
        assert done.query(), "the copy had its turn but its event was not set inside it"
        # an engine that then does not step (nothing to run) leaves later copies free to go
        gate.give_turn()
        later = stream.submit([lambda: busy(0.001) for _ in range(30)])
        assert later.wait(5)
    finally:
        stream.close()
