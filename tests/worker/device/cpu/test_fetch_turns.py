"""On the CPU, store fetches get turns between the decode steps (``step_gate.py``): while a fetch
is in flight and sequences run, the engine holds each gap open for ``fetch_turn_s`` before it
schedules, so the idle-priority fetch process gets the cores; a copy thread waiting for the gap
may take its one turn in it; nothing is held without a fetch, with nothing running, or with the
setting at 0."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from lorastream.core.generation import PromptInput, SamplingParams
from lorastream.worker.device.cpu.step_gate import StepGate
from lorastream.worker.device.device import Device, LoadStream
from lorastream.worker.engine.engine import Engine
from tests.worker.conftest import PROMPTS, EngineFactory, StoreStack, busy, greedy_tokens


@pytest.mark.parametrize("turn_s", [0.0, 0.01], ids=["copy-turns-off", "copy-turns-on"])
def test_a_held_gap_keeps_the_engine_out_for_its_length(turn_s: float) -> None:
    gate = StepGate(turn_s=turn_s)
    began = time.monotonic()
    gate.hold_gap(0.03)
    assert time.monotonic() - began >= 0.03
    assert gate.holds == 1
    with gate.step():  # and the next step starts as before
        pass


def test_a_copy_waiting_for_the_gap_takes_its_one_turn_inside_the_hold() -> None:
    gate = StepGate(turn_s=0.01)
    stream = LoadStream(torch.device("cpu"), gate=gate)
    ran: list[float] = []

    def op() -> None:
        busy(0.002)
        ran.append(time.monotonic())

    try:
        with gate.step():
            done = stream.submit([op for _ in range(30)])  # ~60 ms: several turns
            time.sleep(0.03)  # the copy thread now waits for the gap
            assert not ran
        held = time.monotonic()
        gate.hold_gap(0.06)  # longer than one turn: still only this gap's turn runs in it
        gate.give_turn()
        after_gap = len(ran)
        assert ran and ran[0] >= held, "the copy did not run inside the held gap"
        assert gate.turns == 1, "a held gap gave the copy thread more than one turn"
        assert 0 < after_gap < 30
        for _ in range(40):  # later gaps give the copy its later turns
            if done.query():
                break
            with gate.step():
                time.sleep(0.002)
            gate.give_turn()
        assert done.wait(5) and done.error is None and len(ran) == 30
    finally:
        stream.close()


@pytest.mark.parametrize(("fetch_turn_s", "fetching", "holds"), [
    (None, True, 0),  # off by default
    (0.004, False, 0),  # no fetch in flight
    (0.004, True, 1),
    (0.0, True, 0),  # turned off
])
def test_a_cpu_device_holds_the_gap_only_while_fetching_and_only_when_asked_to(
    fetch_turn_s: float | None, fetching: bool, holds: int
) -> None:
    device = Device("cpu") if fetch_turn_s is None else Device("cpu", fetch_turn_s=fetch_turn_s)
    try:
        device.between_steps(fetching=fetching)
        assert device.gate.holds == holds
    finally:
        device.close()


class _KeepDecoding:
    """Base-model streams one after another (the tiny model's context ends each after ~250
    tokens) until :meth:`stop`: there is a running sequence all along."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()
        while engine.stats.steps < 3:
            time.sleep(0.005)

    def _run(self) -> None:
        while not self._stop.is_set():
            stream = self._engine.submit("tiny", PromptInput(token_ids=tuple(PROMPTS[0])),
                                         SamplingParams(max_tokens=240, ignore_eos=True))
            for _ in stream:
                if self._stop.is_set():
                    stream.cancel()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


@pytest.mark.parametrize("fetch_turn_ms", [0.0, 3.0], ids=["off", "3ms"])
def test_the_engine_holds_its_gaps_while_a_fetch_is_in_flight_and_a_stream_decodes(
    engine_factory: EngineFactory, store: StoreStack, reference: dict[tuple[str, int], list[int]],
    fetch_turn_ms: float,
) -> None:
    # the load share (test_load_share.py) off: the fixed turns alone
    engine = engine_factory(store=store.target, fetch_turn_ms=fetch_turn_ms, load_share=0.0)
    gate = engine.device.gate
    engine.adapters.fetcher.chunk_delay_s = 0.4  # the adapter takes >= 0.4 s to arrive
    decoding = _KeepDecoding(engine)
    try:
        time.sleep(0.1)
        assert gate.holds == 0, "the engine held its gaps with no fetch in flight"
        steps_before = engine.stats.steps
        assert greedy_tokens(engine, "attn-r4", 0) == reference[("attn-r4", 0)]
        holds, steps = gate.holds, engine.stats.steps - steps_before
        time.sleep(0.1)  # the fetch has landed: the streams decode on, with no holds
        assert gate.holds == holds
    finally:
        decoding.stop()
    if fetch_turn_ms:
        # the gaps between the streams' steps were held while the fetch was in flight (not
        # the steps after it: the adapter's copy and its own steps)
        assert 3 <= holds <= steps, f"{holds} gaps held over {steps} steps of a >= 0.4 s fetch"
    else:
        assert holds == 0


def test_an_engine_with_nothing_running_does_not_hold_for_a_fetch(
    engine_factory: EngineFactory, store: StoreStack, reference: dict[tuple[str, int], list[int]]
) -> None:
    engine = engine_factory(store=store.target, fetch_turn_ms=3.0)
    engine.adapters.fetcher.chunk_delay_s = 0.3
    assert greedy_tokens(engine, "mlp-r8", 1) == reference[("mlp-r8", 1)]
    assert engine.device.gate.holds == 0
