"""Prefix caching in the engine, every model family: the same greedy tokens and logprobs with the
cache on and off, in mixed batches of adapters and the base model, over whole-block and
partial-block prefixes with chunked prefill (sliding windows of 6 tokens, shorter than the cached
prefixes); and what must never be shared is not (adapter versions, adapters, base model)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from lorastream.core.generation import GenerationEvent, PromptInput, SamplingParams
from lorastream.worker.engine.engine import Engine
from lorastream.worker.model.kv_cache import BLOCK_SIZE
from lorastream.worker.service.bootstrap import build_engine
from lorastream.worker.service.config import WorkerSettings
from tests.support.families import adapter_specs
from tests.support.models import FAMILY_CONFIGS, WINDOW, make_family_adapter, make_tiny_family

BASE = "base"
ADAPTERS = ("attn-r4", "all-r16-rslora")
MODELS = (BASE, *ADAPTERS)
SYSTEM = [(i * 37 + 11) % 250 + 3 for i in range(40)]  # blocks 0, 1 full; 8 tokens of block 2
WARM = [*SYSTEM, 201, 202]
# name -> (prompt, prompt tokens the cache must give it after WARM ran)
PREFIXES: dict[str, tuple[list[int], int]] = {
    "same-prompt": (WARM, 32),
    "whole-blocks": ([*SYSTEM[:32], 50, 51, 52], 32),
    "exactly-two-blocks+1": (SYSTEM[:33], 32),
    "exactly-two-blocks": (SYSTEM[:32], 16),  # its last token is computed: block 1 is not taken
    "partial-block": ([*SYSTEM[:24], 9, 8, 7, 6, 5, 4, 3, 2], 16),
    "no-shared-block": (SYSTEM[:10] + [4] * 20, 0),
}
NEW_TOKENS = 6


@dataclass(frozen=True)
class Case:
    family: str
    checkpoint: Path
    adapters: dict[str, Path]


@pytest.fixture(scope="module", params=list(FAMILY_CONFIGS))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    root = tmp_path_factory.mktemp(f"prefix-{request.param}")
    checkpoint = make_tiny_family(request.param, root / "model")
    specs = adapter_specs(request.param)
    adapters = {
        name: make_family_adapter(checkpoint, root / name, **specs[name])  # type: ignore[arg-type]  # specs: the function's own keywords
        for name in ADAPTERS
    }
    return Case(request.param, checkpoint, adapters)


def make_engine(case: Case, tmp: Path, prefix_caching: bool, **overrides: object) -> Engine:
    settings = WorkerSettings(
        model=str(case.checkpoint), served_model_name=BASE, model_cache_dir=tmp / "models",
        max_loras=4, max_lora_rank=16, prefix_caching=prefix_caching,
        **{"kv_cache_bytes": 4 << 20, "max_num_tokens": 24, **overrides},  # type: ignore[arg-type]  # the settings' own fields
    )
    engine = build_engine(settings, checkpoint=case.checkpoint)
    for name, path in case.adapters.items():
        engine.adapters.load(name, path, False, 60)
    return engine.start()


@pytest.fixture
def engines(case: Case, tmp_path: Path) -> Iterator[dict[bool, Engine]]:
    made = {on: make_engine(case, tmp_path / str(on), on) for on in (True, False)}
    yield made
    for engine in made.values():
        engine.stop()
        assert engine.healthy_after_stop(), "KV blocks or adapter references leaked"


@dataclass
class Outcome:
    tokens: list[int]
    logprobs: list[float]
    top: list[tuple[int, ...]]
    cached: int


def run_batch(
    engine: Engine, requests: list[tuple[str, list[int]]], **params: object
) -> list[Outcome]:
    """Submit every request before reading any (they run as one mixed batch), greedy."""
    sampling = SamplingParams(**{"max_tokens": NEW_TOKENS, "logprobs": 3, **params})  # type: ignore[arg-type]  # params: SamplingParams' own fields
    streams = [engine.submit(m, PromptInput(token_ids=tuple(p)), sampling) for m, p in requests]
    outcomes = []
    for stream in streams:
        events: list[GenerationEvent] = list(stream)
        outcomes.append(Outcome(
            [t for e in events for t in e.token_ids],
            [lp.logprob for e in events for lp in e.logprobs],
            [tuple(t.token_id for t in lp.top) for e in events for lp in e.logprobs],
            events[-1].cached_tokens,
        ))
    return outcomes


def assert_same(on: list[Outcome], off: list[Outcome], labels: list[str]) -> None:
    for a, b, label in zip(on, off, labels, strict=True):
        assert a.tokens == b.tokens, label
        assert a.top == b.top, label
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4), label


def test_greedy_tokens_and_logprobs_equal_with_the_cache_on_and_off(
    case: Case, engines: dict[bool, Engine]
) -> None:
    assert len(SYSTEM) > WINDOW and len(WARM) > 24  # windows and chunked prefill are in play
    warm = [(m, WARM) for m in MODELS]
    later = [(m, prompt) for name, (prompt, _) in PREFIXES.items() for m in MODELS]
    labels = [f"{case.family} {m} {name}" for name in PREFIXES for m in MODELS]
    outcomes = {}
    for on, engine in engines.items():
        first = run_batch(engine, warm)
        assert all(o.cached == 0 for o in first)  # nothing was cached yet
        outcomes[on] = first + run_batch(engine, later)
    assert_same(outcomes[True], outcomes[False], [f"warm {m}" for m in MODELS] + labels)
    expected = [hit for _, hit in PREFIXES.values() for _ in MODELS]
    assert [o.cached for o in outcomes[True][len(warm):]] == expected
    assert all(o.cached == 0 for o in outcomes[False])
    stats = engines[True].prefix.stats
    assert stats.hit_tokens == sum(expected) and 0 < stats.hit_rate < 1
    # the models differ, so sharing blocks across them would have shown in the logprobs
    logprobs = {tuple(round(x, 3) for x in o.logprobs) for o in outcomes[False][: len(MODELS)]}
    assert len(logprobs) == len(MODELS)


def test_n_choices_share_cached_prompt_blocks_and_match_the_cache_off(
    case: Case, engines: dict[bool, Engine]
) -> None:
    prompt = [*SYSTEM, 11, 12, 13]
    results = {}
    for on, engine in engines.items():
        run_batch(engine, [(m, prompt) for m in MODELS])
        results[on] = [
            [t for e in engine.submit(m, PromptInput(token_ids=tuple(prompt)),
                                      SamplingParams(max_tokens=NEW_TOKENS, n=3))
             for t in e.token_ids]
            for m in MODELS
        ]
    assert results[True] == results[False]
    assert engines[True].prefix.stats.hit_tokens >= len(MODELS) * 2 * BLOCK_SIZE


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Case:
    root = tmp_path_factory.mktemp("prefix-llama")
    checkpoint = make_tiny_family("llama", root / "model")
    specs = adapter_specs("llama")
    adapters = {
        name: make_family_adapter(checkpoint, root / name, **specs[name])  # type: ignore[arg-type]  # specs: the function's own keywords
        for name in ADAPTERS
    }
    # a second version of attn-r4: other weights, pushed later under the same name
    adapters["attn-r4-v2"] = make_family_adapter(
        checkpoint, root / "attn-r4-v2", **{**specs["attn-r4"], "seed": 99}  # type: ignore[arg-type]  # specs: the function's own keywords
    )
    return Case("llama", checkpoint, adapters)


def test_a_new_version_under_the_same_name_never_reuses_the_old_blocks(
    llama: Case, tmp_path: Path
) -> None:
    on = make_engine(Case("llama", llama.checkpoint, {}), tmp_path / "on", True)
    off = make_engine(Case("llama", llama.checkpoint, {}), tmp_path / "off", False)
    try:
        prompt = WARM
        on.adapters.load("prod", llama.adapters["attn-r4"], False, 60)
        assert run_batch(on, [("prod", prompt)])[0].cached == 0
        assert run_batch(on, [("prod", prompt)])[0].cached == 32  # the same version hits
        on.adapters.unload("prod")
        on.adapters.load("prod", llama.adapters["attn-r4-v2"], False, 60)
        got = run_batch(on, [("prod", prompt)])[0]
        assert got.cached == 0  # the old version's blocks are not the new one's
        off.adapters.load("prod", llama.adapters["attn-r4-v2"], False, 60)
        assert_same([got], run_batch(off, [("prod", prompt)]), ["v2"])
        assert run_batch(on, [("prod", prompt)])[0].cached == 32  # v2's own blocks hit
    finally:
        for engine in (on, off):
            engine.stop()
            assert engine.healthy_after_stop()


@pytest.mark.parametrize("quantization", ["int8", "int8-dynamic"])
def test_quantized_bases_give_the_same_tokens_with_the_cache_on_and_off(
    llama: Case, tmp_path: Path, quantization: str
) -> None:
    made = {on: make_engine(llama, tmp_path / str(on), on, quantization=quantization)
            for on in (True, False)}
    try:
        requests = [(m, prompt) for prompt, _ in PREFIXES.values() for m in MODELS]
        outcomes = {}
        for on, engine in made.items():
            outcomes[on] = run_batch(engine, [(m, WARM) for m in MODELS])
            outcomes[on] += run_batch(engine, requests)
        assert_same(outcomes[True], outcomes[False], [str(r) for r in MODELS + tuple(
            f"{m} {name}" for name in PREFIXES for m in MODELS)])
        assert made[True].prefix.stats.hit_tokens > 0
    finally:
        for engine in made.values():
            engine.stop()


def test_adapters_and_the_base_model_never_share_blocks(llama: Case, tmp_path: Path) -> None:
    engine = make_engine(llama, tmp_path, True)
    try:
        for model in MODELS:  # each sees the same prompt first: nothing of another's matches
            assert run_batch(engine, [(model, WARM)])[0].cached == 0
        assert [o.cached for o in run_batch(engine, [(m, WARM) for m in MODELS])] == [32] * 3
    finally:
        engine.stop()


def test_distinct_prompts_stay_within_the_budget_and_never_evict_a_running_request(
    llama: Case, tmp_path: Path
) -> None:
    """40 blocks; a long request decodes while 60 distinct prompts come and go: idle blocks are
    recycled (evictions), the long request's blocks are never taken (its tokens equal those of
    the same request run alone with the cache off)."""
    budget = 40
    per_block = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16, fp32
    on = make_engine(llama, tmp_path / "on", True, kv_cache_bytes=budget * per_block,
                     max_batch_size=4)
    off = make_engine(llama, tmp_path / "off", False, kv_cache_bytes=budget * per_block)
    try:
        assert on.kv.num_blocks == budget
        rng = random.Random(7)
        long_prompt = SYSTEM[:20]
        long_stream = on.submit(BASE, PromptInput(token_ids=tuple(long_prompt)),
                                SamplingParams(max_tokens=120, ignore_eos=True))
        others = [([rng.randrange(3, 250) for _ in range(rng.randrange(20, 70))], m)
                  for m in MODELS for _ in range(20)]
        for prompt, model in others:
            run_batch(on, [(model, prompt)], max_tokens=3, logprobs=None)
            allocator = on.kv.allocator
            assert allocator.cached_blocks <= budget and allocator.used_blocks <= budget
        long_tokens = [t for e in long_stream for t in e.token_ids]
        assert on.kv.allocator.evictions > 0
        alone = [t for e in off.submit(BASE, PromptInput(token_ids=tuple(long_prompt)),
                                       SamplingParams(max_tokens=120, ignore_eos=True))
                 for t in e.token_ids]
        assert long_tokens == alone
    finally:
        for engine in (on, off):
            engine.stop()
            assert engine.healthy_after_stop()


def scraped(engine: Engine, name: str) -> float:
    from prometheus_client import generate_latest

    text = generate_latest(engine.adapters.metrics.registry).decode()
    line = next(x for x in text.splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


def test_metrics_show_cached_blocks_and_hit_rate_and_reset_forgets_every_prefix(
    llama: Case, tmp_path: Path
) -> None:
    engine = make_engine(llama, tmp_path, True)
    try:
        run_batch(engine, [(BASE, WARM)])
        assert scraped(engine, "lorastream_worker_prefix_cache_blocks") == 2  # 47 tokens computed
        assert scraped(engine, "lorastream_worker_prefix_cache_hit_rate") == 0
        assert run_batch(engine, [(BASE, WARM)])[0].cached == 32
        assert scraped(engine, "lorastream_worker_prefix_cache_hit_rate") == pytest.approx(
            32 / (2 * len(WARM)))
        engine.reset_prefix_cache()
        assert run_batch(engine, [(BASE, WARM)])[0].cached == 0
        assert engine.prefix.stats.resets == 1
    finally:
        engine.stop()
