"""On the CPU, a request waiting for its adapter's store fetch gets the loaders a share of the
cores (``--load-share``, ``step_gate.py``): while it waits and sequences decode back to back,
the engine holds each gap for ``share / (1 - share)`` of the step before it, so over steps and
held gaps the loaders get ``share`` of the wall time; nothing is held once it is admitted, or
with the share at 0 (then an engine stepping back to back leaves the idle-priority fetch only
what decoding does not use: the starvation of issue 57)."""

from __future__ import annotations

import threading
import time

import pytest

from lorastream.core.generation import PromptInput, SamplingParams
from lorastream.worker.device.cpu.step_gate import MAX_HOLD_S, StepGate
from lorastream.worker.device.device import Device
from lorastream.worker.engine.engine import Engine
from tests.worker.conftest import PROMPTS, EngineFactory, StoreStack, busy, greedy_tokens


@pytest.mark.parametrize("turn_s", [0.0, 0.02], ids=["copy-turns-off", "copy-turns-on"])
@pytest.mark.parametrize("share", [0.1, 0.25, 0.5])
def test_held_gaps_give_the_loaders_their_share_of_the_wall_time(
    turn_s: float, share: float
) -> None:
    gate = StepGate(turn_s=turn_s)
    for _ in range(5):
        with gate.step():
            busy(0.01)
        gate.hold_share(share)
    assert gate.holds == 5
    assert [kind for kind, _ in gate.record] == ["step", "hold"] * 5
    assert gate.held_s / (gate.held_s + gate.stepped_s) >= share


def test_a_held_gap_is_bounded_however_long_the_step() -> None:
    gate = StepGate(turn_s=0.0)
    with gate.step():
        busy(0.12)
    began = time.monotonic()
    gate.hold_share(0.5)  # 0.12 s asked for, MAX_HOLD_S given
    assert gate.record[-1][0] == "hold"
    assert MAX_HOLD_S <= time.monotonic() - began < 0.12


@pytest.mark.parametrize(("share", "fetching", "cold_waiting", "holds"), [
    (0.15, True, True, 1),
    (0.15, True, False, 0),  # a fetch no request waits for (the share is for cold requests)
    (0.15, False, False, 0),  # nothing in flight
    (0.0, True, True, 0),  # turned off
])
def test_a_cpu_device_holds_for_the_share_only_while_a_request_waits_for_a_fetch(
    share: float, fetching: bool, cold_waiting: bool, holds: int
) -> None:
    device = Device("cpu", load_share=share)
    try:
        with device.step():
            busy(0.005)
        device.between_steps(fetching=fetching, cold_waiting=cold_waiting)
        assert device.gate.holds == holds
    finally:
        device.close()


class _Decoding:
    """``streams`` base-model streams decoding back to back until :meth:`stop`: the engine
    steps without a pause, as a saturated CPU worker does."""

    def __init__(self, engine: Engine, streams: int) -> None:
        self._engine = engine
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(streams)]
        for thread in self._threads:
            thread.start()
        while engine.stats.steps < 5:
            time.sleep(0.005)

    def _run(self, i: int) -> None:
        while not self._stop.is_set():
            stream = self._engine.submit("tiny", PromptInput(token_ids=tuple(PROMPTS[i % 2])),
                                         SamplingParams(max_tokens=240, ignore_eos=True))
            for _ in stream:
                if self._stop.is_set():
                    stream.cancel()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)


def test_a_cold_request_gets_its_share_of_every_gap_while_decoding_saturates_the_engine(
    engine_factory: EngineFactory, store: StoreStack, reference: dict[tuple[str, int], list[int]]
) -> None:
    share = 0.25
    engine = engine_factory(store=store.target, load_share=share)
    gate = engine.device.gate
    engine.adapters.fetcher.chunk_delay_s = 0.4  # the cold adapter is in flight >= 0.4 s
    decoding = _Decoding(engine, streams=3)
    try:
        time.sleep(0.05)
        assert gate.holds == 0, "the engine held its gaps with no cold request waiting"
        gate.record.clear()
        assert greedy_tokens(engine, "attn-r4", 0) == reference[("attn-r4", 0)]
        during = list(gate.record)
        holds = gate.holds
        steps_after = engine.stats.steps
        while engine.stats.steps < steps_after + 10:  # the adapter is in: decoding goes on
            time.sleep(0.005)
        assert gate.holds == holds, "the engine held its gaps with nothing waiting"
    finally:
        decoding.stop()
    during = during[[kind for kind, _ in during].index("step"):]  # from a step on
    kinds = [kind for kind, _ in during]
    assert "hold" in kinds, "no gap held while a cold request waited: its load was starved"
    first, last = kinds.index("hold"), len(kinds) - 1 - kinds[::-1].index("hold")
    waiting = during[first - 1 : last + 1]  # the step before the first hold .. the last hold
    steps = [seconds for kind, seconds in waiting if kind == "step"]
    held = [seconds for kind, seconds in waiting if kind == "hold"]
    # every gap while the request waited was held, each after the step it pays for ...
    assert len(held) >= 3, f"only {len(held)} gaps held during a >= 0.4 s fetch"
    assert [kind for kind, _ in waiting] == ["step", "hold"] * len(held), kinds
    # ... for its share of that step (bounded), so the loaders got their share of the wall time
    for step, hold in zip(steps, held, strict=True):
        assert hold >= min(share / (1 - share) * step, MAX_HOLD_S)
    assert sum(held) / (sum(held) + sum(steps)) >= share * 0.999 or max(held) >= MAX_HOLD_S


def test_a_request_resolving_a_cold_adapter_gets_its_share_before_its_fetch(
    engine_factory: EngineFactory, store: StoreStack, reference: dict[tuple[str, int], list[int]]
) -> None:
    """A request for an adapter this worker does not hold first waits on the store for its
    manifest (DescribeAdapter, on the request's thread, before it reaches the scheduler): on a
    box that also runs the store, an engine stepping back to back starved that call as it
    starved fetches (a burst's cold requests resolved in 360 ms against 200 with overlap off).
    The engine holds its gaps for that wait too, and only while it lasts."""
    share = 0.25
    engine = engine_factory(store=store.target, load_share=share)
    gate, fetcher = engine.device.gate, engine.adapters.fetcher
    fetcher.describe_delay_s = 0.4  # the store answers the manifest >= 0.4 s late
    decoding = _Decoding(engine, streams=3)
    tokens: list[int] = []
    try:
        time.sleep(0.05)
        assert gate.holds == 0, "the engine held its gaps with no cold request waiting"
        request = threading.Thread(target=lambda: tokens.extend(greedy_tokens(
            engine, "attn-r4", 0)))
        request.start()
        while not fetcher.describing:
            time.sleep(0.001)
        holds = gate.holds
        time.sleep(0.2)
        assert fetcher.describing and not engine.adapters.fetching  # still resolving
        assert gate.holds >= holds + 3, "no gap held while a request waited for its manifest"
        request.join(timeout=60)
        steps_after = engine.stats.steps
        holds = gate.holds
        while engine.stats.steps < steps_after + 10:  # the adapter is in: decoding goes on
            time.sleep(0.005)
        assert gate.holds == holds, "the engine held its gaps with nothing waiting"
    finally:
        decoding.stop()
    assert tokens == reference[("attn-r4", 0)]
