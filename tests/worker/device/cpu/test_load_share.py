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
from lorastream.core.manifest import AdapterManifest
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


@pytest.mark.parametrize("arrivals", [
    [False, True, False, False],  # one arrival: its gap is not held, the next holds twice
    [True, True, True, True],  # arrivals at every gap: never two deferrals in a row
    [False, False, False, False],
])
def test_a_hold_gives_way_to_arrivals_that_need_no_load_and_is_owed(
    arrivals: list[bool],
) -> None:
    share = 0.2
    gate = StepGate(turn_s=0.0)
    for arrived in arrivals:
        with gate.step():
            busy(0.01)
        gate.hold_share(share, defer=arrived)
    gaps = [(kind, seconds) for kind, seconds in gate.record if kind != "step"]
    assert len(gaps) == len(arrivals)
    deferred = False
    for arrived, (kind, seconds) in zip(arrivals, gaps, strict=True):
        # an arrival's gap is not held, unless the gap before it was not held either ...
        assert kind == ("defer" if arrived and not deferred else "hold")
        if kind == "hold":  # ... and a hold after a deferral pays for both gaps' shares
            assert seconds >= share / (1 - share) * 0.01 * (2 if deferred else 1) * 0.999
        deferred = kind == "defer"
    # over the gaps, the loaders got their share of the wall time but for a last deferral owed
    owed = gate.owed_s
    assert (gate.held_s + owed) / (gate.held_s + owed + gate.stepped_s) >= share * 0.999
    gate.forgive()
    assert gate.owed_s == 0.0


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
    gaps = [(kind, seconds) for kind, seconds in waiting if kind != "step"]
    held = [seconds for kind, seconds in gaps if kind == "hold"]
    # every gap while the request waited was held, each after the step it pays for (or, when a
    # stream's next request arrived, deferred to the next gap: never two in a row) ...
    assert len(held) >= 3, f"only {len(held)} gaps held during a >= 0.4 s fetch"
    assert [kind for kind, _ in waiting][::2] == ["step"] * len(gaps), kinds
    assert "defer defer" not in " ".join(kind for kind, _ in gaps), kinds
    # ... for its share of that step, and of the deferred one's (bounded), so the loaders got
    # their share of the wall time
    owed = 0.0
    for step, (kind, seconds) in zip(steps, gaps, strict=True):
        want = min(share / (1 - share) * step + owed, MAX_HOLD_S)
        if kind == "hold":
            assert seconds >= want
        owed = want if kind == "defer" else 0.0
    assert sum(held) / (sum(held) + sum(steps)) >= share * 0.999 or max(held) >= MAX_HOLD_S


def test_a_request_resolving_a_cold_adapter_gets_its_share_before_its_fetch(
    engine_factory: EngineFactory, store: StoreStack, reference: dict[tuple[str, int], list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request for an adapter this worker does not hold first waits on the store for its
    manifest (DescribeAdapter, on the request's thread, before it reaches the scheduler): on a
    box that also runs the store, an engine stepping back to back starved that call as it
    starved fetches (a burst's cold requests resolved in 360 ms against 200 with overlap off).
    The engine holds its gaps for that wait too, and only while it lasts."""
    share = 0.25
    engine = engine_factory(store=store.target, load_share=share)
    gate, fetcher = engine.device.gate, engine.adapters.fetcher
    client = fetcher.client
    assert client is not None
    store_describe = client.describe

    def late_describe(name: str) -> AdapterManifest:  # the store answers >= 0.4 s late
        time.sleep(0.4)
        return store_describe(name)

    monkeypatch.setattr(client, "describe", late_describe)
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


def test_a_request_needing_no_load_is_not_held_behind_a_cold_ones_share(
    engine_factory: EngineFactory, store: StoreStack, reference: dict[tuple[str, int], list[int]]
) -> None:
    """While a cold request waits (its gaps held), a request whose adapter is on the device
    arrives: the gap before its prefill is not held (the hold is owed to the next gap)."""
    engine = engine_factory(store=store.target, load_share=0.5)
    gate = engine.device.gate
    assert greedy_tokens(engine, "mlp-r8", 1) == reference[("mlp-r8", 1)]  # resident now
    engine.adapters.fetcher.chunk_delay_s = 0.6  # the cold adapter is in flight >= 0.6 s
    decoding = _Decoding(engine, streams=2)
    cold: list[int] = []
    try:
        request = threading.Thread(target=lambda: cold.extend(greedy_tokens(
            engine, "attn-r4", 0)))
        request.start()
        while gate.holds < 3:  # the cold request waits, its gaps held
            time.sleep(0.001)
        mark = len(gate.record)
        stream = engine.submit("mlp-r8", PromptInput(token_ids=tuple(PROMPTS[1])),
                               SamplingParams(max_tokens=1, ignore_eos=True))
        resident = [token for event in stream for token in event.token_ids]
        after = [kind for kind, _ in list(gate.record)[mark:]]
        assert engine.adapters.fetching, "the cold fetch ended before the resident request ran"
        request.join(timeout=60)
    finally:
        decoding.stop()
    assert "defer" in after, after  # the resident request's gap was not held
    assert resident == reference[("mlp-r8", 1)][:1] and cold == reference[("attn-r4", 0)]
