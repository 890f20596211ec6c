"""Layer-ordered admission (``--layered-admission``): a cold request is admitted once its
adapter's first layers are in a slot, its prefill runs each layer as it lands, and its tokens
are HF + PEFT's. Slowed with the fetch's chunk delay so the layers land far apart; real store
on loopback, real engine. Leaks are checked at teardown (``engine_factory``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from lorastream.core import errors
from lorastream.core.generation import PromptInput, SamplingParams
from lorastream.core.store_client import StoreClient
from lorastream.worker.engine.engine import Engine
from lorastream.worker.engine.layered_prefill import round_stop
from lorastream.worker.loading.device_tier import DeviceTier
from tests.store.test_fast_verify import _flip_byte
from tests.worker.conftest import PROMPTS, EngineFactory, StoreStack, greedy_tokens

pytestmark = pytest.mark.timeout(120)  # a request stuck in landing fails, not hangs, the run


def _slow(engine: Engine) -> None:
    """About 0.2 s per layer of the tiny model's rank-64 adapter: its layers land apart."""
    engine.adapters.fetcher.chunk_bytes = 8192
    engine.adapters.fetcher.chunk_delay_s = 0.01


@pytest.mark.parametrize("layered", [True, False], ids=["layered", "whole"])
def test_a_cold_request_runs_its_landed_layers_early_and_gives_peft_tokens(
    engine_factory: EngineFactory, store: StoreStack, reference: dict[tuple[str, int], list[int]],
    layered: bool,
) -> None:
    engine = engine_factory(store=store.target, layered_admission=layered)
    _slow(engine)
    assert greedy_tokens(engine, "all-r64", 1) == reference[("all-r64", 1)]
    layers = engine.slots.num_layers
    if layered:  # all of its prefill's layers ran before its last token's step; some early
        assert engine.layered is not None
        assert engine.layered.layers_run == layers
        assert 0 < engine.layered.early_layers < layers
    else:  # nothing of it is there: no layered prefill in the engine or its scheduler
        assert engine.layered is None and engine.scheduler.layered is None


@pytest.mark.parametrize(("done", "ready", "tokens", "budget", "stop"), [
    (0, 30, 38, 2048, 30),  # a short prompt: every landed layer at once
    (0, 30, 4000, 2048, 15),  # a long one: half the layers' worth of a full step
    (15, 30, 4000, 2048, 30),
    (3, 5, 4000, 2048, 5),  # never past what is ready
    (0, 30, 100_000, 8, 1),  # at least one layer a round
])
def test_a_round_runs_at_most_a_step_s_worth_of_token_layers(
    done: int, ready: int, tokens: int, budget: int, stop: int
) -> None:
    assert round_stop(done, ready, tokens, budget, 30) == stop


def test_a_long_prompt_goes_over_several_rounds_and_stays_exact(
    engine_factory: EngineFactory, store: StoreStack, reference: dict[tuple[str, int], list[int]]
) -> None:
    """``max_num_tokens`` 8: the 18 tokens before prompt 1's last one take a layer a round."""
    engine = engine_factory(store=store.target, layered_admission=True, max_num_tokens=8)
    _slow(engine)
    assert greedy_tokens(engine, "all-r64", 1) == reference[("all-r64", 1)]
    assert engine.layered.layers_run == engine.layered.spans == engine.slots.num_layers


def test_streams_decoding_meanwhile_and_a_resident_adapter_stay_exact(
    engine_factory: EngineFactory, store: StoreStack, reference: dict[tuple[str, int], list[int]]
) -> None:
    """A cold request lands layer by layer while the base model and a resident adapter decode
    in the batch; every one of them gets its own reference tokens, n > 1 included."""
    engine = engine_factory(store=store.target, layered_admission=True)
    assert greedy_tokens(engine, "attn-r4", 0) == reference[("attn-r4", 0)]  # now resident
    _slow(engine)
    results: dict[str, list[int]] = {}

    def run(name: str, prompt: int) -> None:
        results[f"{name}/{prompt}"] = greedy_tokens(engine, name, prompt)

    threads = [threading.Thread(target=run, args=a) for a in
               [("tiny", 0), ("attn-r4", 2), ("all-r16-rslora", 1), ("mlp-r8", 0)]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == {
        "tiny/0": reference[("base", 0)], "attn-r4/2": reference[("attn-r4", 2)],
        "all-r16-rslora/1": reference[("all-r16-rslora", 1)],
        "mlp-r8/0": reference[("mlp-r8", 0)],
    }
    assert engine.layered.early_layers > 0
    # two choices of one cold request: forked after the last prompt token, as for any request
    stream = engine.submit("all-r64", PromptInput(token_ids=tuple(PROMPTS[1])),
                           SamplingParams(max_tokens=6, n=2))
    by_choice: dict[int, list[int]] = {0: [], 1: []}
    for event in stream:
        by_choice[event.index] += list(event.token_ids)
    assert by_choice[0] == by_choice[1] == reference[("all-r64", 1)][:6]


def test_a_damaged_later_layer_fails_the_request_after_its_early_layers_ran(
    engine_factory: EngineFactory, store: StoreStack, reference: dict[tuple[str, int], list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Layer 0 lands and runs; a byte of the last layer was damaged on the store's disk: the
    request fails with the digest error (never served by a partial adapter), its slot and
    blocks come back, and a request for a sound adapter goes on."""
    with StoreClient(store.target) as client:
        manifest = client.describe("all-r64")
    last = max(i for i, t in enumerate(manifest.tensors) if ".layers.1." in t.name)
    _flip_byte(store.cache, manifest, last)
    engine = engine_factory(store=store.target, layered_admission=True)
    _slow(engine)
    calls: list[tuple[str, list[int]]] = []  # each span holds its slot until its read is recorded
    for name in ("hold", "release"):
        original = getattr(DeviceTier, name)

        def spy(self: DeviceTier, slots: list[int], *args: object, _name: str = name,
                _original: Callable[..., None] = original) -> None:
            calls.append((_name, list(slots)))
            _original(self, slots, *args)

        monkeypatch.setattr(DeviceTier, name, spy)
    with pytest.raises(errors.InvalidAdapter, match="mismatch"):
        greedy_tokens(engine, "all-r64", 1)
    assert engine.layered.early_layers >= 1
    assert len(calls) == 2 * engine.layered.spans
    assert all(calls[i][0] == "hold" and calls[i + 1] == ("release", calls[i][1])
               for i in range(0, len(calls), 2))
    state = engine.adapters.inspect("all-r64")
    assert state is not None and state.slot is None  # the partly filled slot was taken back
    assert greedy_tokens(engine, "mlp-r8", 0) == reference[("mlp-r8", 0)]


def test_a_request_cancelled_while_its_adapter_lands_leaves_nothing_behind(
    engine_factory: EngineFactory, store: StoreStack
) -> None:
    engine = engine_factory(store=store.target, layered_admission=True)
    _slow(engine)
    stream = engine.submit("all-r64", PromptInput(token_ids=tuple(PROMPTS[1])),
                           SamplingParams(max_tokens=12))
    deadline = time.monotonic() + 30
    while not engine.layered.layers_run and time.monotonic() < deadline:
        time.sleep(0.005)
    assert engine.scheduler.landing  # admitted, prefilling layer by layer
    stream.cancel()
    events = list(stream)
    assert events and events[-1].finish_reason is not None
    assert not engine.scheduler.landing


@pytest.mark.parametrize(("overrides", "on"), [
    ({}, False),  # the default
    ({"layered_admission": True, "lora_overlap_loading": False}, False),  # it needs overlap
    ({"layered_admission": True}, True),
], ids=["default", "no-overlap", "on"])
def test_the_engine_holds_a_layered_prefill_only_with_the_setting_on(
    engine_factory: EngineFactory, overrides: dict[str, object], on: bool
) -> None:
    """Off, the engine, its scheduler and the adapter manager hold nothing of layer-ordered
    admission: the step loop's one ``if self.layered is not None`` is all that is left of it."""
    engine = engine_factory(start=False, **overrides)
    assert (engine.layered is not None) is on
    assert engine.scheduler.layered is engine.layered
    assert engine.adapters.layered is on
    assert engine.scheduler.landing == []
