"""Engine behaviour: bad input is refused clearly and loses nothing; cancellation, admission
within the KV budget, continuous batching and seeded sampling."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest

from lorastream.core import errors
from lorastream.core.generation import FinishReason, PromptInput
from lorastream.worker.engine.sampling import SamplingParams
from lorastream.worker.service.operations import WorkerOperations
from tests.support.models import make_peft_adapter, make_tiny_llama
from tests.worker.conftest import PROMPTS, EngineFactory


def _tokens(stream) -> tuple[list[int], FinishReason | None]:
    tokens, reason = [], None
    for event in stream:
        tokens.extend(event.token_ids)
        reason = event.finish_reason
    return tokens, reason


def _prompt(i: int = 0) -> PromptInput:
    return PromptInput(token_ids=tuple(PROMPTS[i]))


def _still_serves(engine, adapter: str = "tiny") -> None:
    tokens, reason = _tokens(engine.submit(adapter, _prompt(), SamplingParams(max_tokens=4)))
    assert tokens and reason is not None


@pytest.fixture(scope="module")
def foreign_adapters(
    tmp_path_factory: pytest.TempPathFactory, tiny_adapters: dict[str, Path]
) -> dict[str, Path]:
    """Adapters that must be refused: another base model's, one adapting a missing layer, one
    adapting a module the worker does not adapt (lm_head)."""
    root = tmp_path_factory.mktemp("foreign")
    other_base = make_tiny_llama(root / "other-base", hidden_size=96, intermediate_size=192)
    deeper_base = make_tiny_llama(root / "deeper-base", num_hidden_layers=4)
    return {
        "other-base": make_peft_adapter(other_base, root / "other", rank=4),
        "extra-layers": make_peft_adapter(deeper_base, root / "deeper", rank=4),
        "lm-head": make_peft_adapter(other_base, root / "lm-head", rank=4, targets=["lm_head"]),
    }


@pytest.mark.parametrize(
    ("adapter", "overrides", "message"),
    [
        ("other-base", {}, "different base model"),
        ("extra-layers", {}, "different base model: it adapts layer 2"),
        ("lm-head", {}, "lm_head"),
        ("all-r64", {"max_lora_rank": 16}, "above this worker's --max-lora-rank 16"),
    ],
)
def test_adapters_that_do_not_fit_are_refused_before_a_slot(
    engine_factory: EngineFactory,
    foreign_adapters: dict[str, Path],
    tiny_adapters: dict[str, Path],
    adapter: str,
    overrides: dict[str, int],
    message: str,
) -> None:
    engine = engine_factory(**overrides)
    path = {**foreign_adapters, **tiny_adapters}[adapter]
    with pytest.raises(errors.InvalidAdapter, match=message):
        WorkerOperations(engine).load_adapter("bad", str(path))
    assert engine.adapters.usage().slots_used == 0
    _still_serves(engine)


@pytest.mark.parametrize(
    ("model", "prompt", "params", "error", "message"),
    [
        ("tiny", PromptInput(token_ids=tuple(range(3, 200)) * 2), SamplingParams(),
         errors.InvalidArgument, "context is 256 tokens"),
        ("tiny", _prompt(), SamplingParams(temperature=-1.0), errors.InvalidArgument,
         "temperature"),
        ("tiny", _prompt(), SamplingParams(top_p=1.5), errors.InvalidArgument, "top_p"),
        ("tiny", _prompt(), SamplingParams(top_k=-2), errors.InvalidArgument, "top_k"),
        ("tiny", _prompt(), SamplingParams(max_tokens=-3), errors.InvalidArgument, "max_tokens"),
        ("tiny", PromptInput(token_ids=(5, 999)), SamplingParams(), errors.InvalidArgument,
         "outside the vocabulary"),
        ("tiny", PromptInput(text=""), SamplingParams(), errors.InvalidArgument, "empty"),
        ("no-such-adapter", _prompt(), SamplingParams(), errors.AdapterNotFound, "no-such-adapter"),
    ],
    ids=["prompt-too-long", "temperature", "top-p", "top-k", "max-tokens", "token-ids", "empty",
         "unknown-adapter"],
)
def test_bad_requests_get_a_clear_error_and_the_worker_keeps_serving(
    engine_factory: EngineFactory,
    model: str,
    prompt: PromptInput,
    params: SamplingParams,
    error: type[Exception],
    message: str,
) -> None:
    engine = engine_factory(max_seq_len=256)
    with pytest.raises(error, match=message):
        engine.submit(model, prompt, params)
    _still_serves(engine)


def test_a_request_that_can_never_fit_the_kv_cache_is_refused(
    engine_factory: EngineFactory,
) -> None:
    engine = engine_factory(kv_cache_bytes=64 << 10)  # a few blocks only
    with pytest.raises(errors.InvalidArgument, match="KV cache blocks"):
        engine.submit("tiny", _prompt(), SamplingParams(max_tokens=200))
    _still_serves(engine)


def test_requests_beyond_the_kv_budget_wait_and_all_complete(engine_factory: EngineFactory) -> None:
    engine = engine_factory(kv_cache_bytes=80 << 10, max_seq_len=256)  # 10 blocks of 8 KiB
    blocks_each = -(-(len(PROMPTS[0]) + 40) // 16)
    assert engine.kv.num_blocks < 8 * blocks_each  # not all eight fit at once
    streams = [engine.submit("tiny", _prompt(), SamplingParams(max_tokens=40, ignore_eos=True))
               for _ in range(8)]
    for stream in streams:
        tokens, reason = _tokens(stream)
        assert len(tokens) == 40 and reason is FinishReason.LENGTH
    assert engine.stats.peak_running * blocks_each <= engine.kv.num_blocks
    assert engine.kv.allocator.used_blocks == 0


def test_a_cancelled_request_leaves_at_once_and_releases_its_slot_references_and_blocks(
    engine_factory: EngineFactory, tiny_adapters: dict[str, Path]
) -> None:
    engine = engine_factory()
    WorkerOperations(engine).load_adapter("mlp-r8", str(tiny_adapters["mlp-r8"]))
    stream = engine.submit("mlp-r8", _prompt(), SamplingParams(max_tokens=200, ignore_eos=True))
    first = next(stream)
    assert first.token_ids
    stream.cancel()
    events = list(stream)
    assert events[-1].finish_reason is FinishReason.CANCELLED
    deadline = time.monotonic() + 5
    while engine.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.adapters.status("mlp-r8").references == 0
    assert engine.kv.allocator.used_blocks == 0
    _still_serves(engine, "mlp-r8")


def test_stopping_ends_every_request_in_flight_with_a_clear_error(
    engine_factory: EngineFactory, tiny_adapters: dict[str, Path]
) -> None:
    engine = engine_factory(max_batch_size=1)
    WorkerOperations(engine).load_adapter("mlp-r8", str(tiny_adapters["mlp-r8"]))
    params = SamplingParams(max_tokens=1000, ignore_eos=True)
    running = engine.submit("mlp-r8", _prompt(), params)
    next(running)
    waiting = engine.submit("tiny", _prompt(1), params)  # the batch is full: it waits
    engine.stop()
    for stream in (running, waiting):
        with pytest.raises(errors.SourceUnavailable, match="shutting down"):
            list(stream)  # ends at once instead of waiting forever
    with pytest.raises(errors.SourceUnavailable, match="shutting down"):
        engine.submit("tiny", _prompt(), params)
    assert engine.healthy_after_stop()
    assert engine.adapters.usage().references == 0


def test_new_requests_join_a_running_batch(engine_factory: EngineFactory) -> None:
    engine = engine_factory()
    long = engine.submit("tiny", _prompt(), SamplingParams(max_tokens=60, ignore_eos=True))
    next(long)  # decoding has started
    short_tokens, _ = _tokens(engine.submit("tiny", _prompt(1), SamplingParams(max_tokens=3)))
    assert short_tokens
    assert engine.stats.peak_running >= 2
    assert len(_tokens(long)[0]) == 59


@pytest.mark.parametrize("seed", [0, 1234])
def test_seeded_sampling_is_reproducible_whatever_else_is_in_the_batch(
    engine_factory: EngineFactory, seed: int
) -> None:
    engine = engine_factory()
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=seed, max_tokens=12,
                            ignore_eos=True)
    alone, _ = _tokens(engine.submit("tiny", _prompt(), params))
    noise = [engine.submit("tiny", _prompt(i % 3), SamplingParams(temperature=1.0, max_tokens=12))
             for i in range(4)]
    crowded, _ = _tokens(engine.submit("tiny", _prompt(), params))
    for stream in noise:
        _tokens(stream)
    assert alone == crowded
    other_seed, _ = _tokens(engine.submit("tiny", _prompt(), SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, seed=seed + 1, max_tokens=12, ignore_eos=True)))
    assert other_seed != alone


def test_stop_strings_end_the_text_before_them(engine_factory: EngineFactory) -> None:
    engine = engine_factory()
    full = "".join(e.text for e in engine.submit(
        "tiny", _prompt(), SamplingParams(max_tokens=30, ignore_eos=True)))
    stop = full[5:7]
    events = list(engine.submit("tiny", _prompt(), SamplingParams(
        max_tokens=30, ignore_eos=True, stop=(stop,))))
    text = "".join(e.text for e in events)
    assert text == full[: full.index(stop)]
    assert events[-1].finish_reason is FinishReason.STOP


def test_a_corrupt_local_adapter_is_refused_and_loses_nothing(
    engine_factory: EngineFactory, tiny_adapters: dict[str, Path], tmp_path: Path
) -> None:
    engine = engine_factory()
    ops = WorkerOperations(engine)
    ops.load_adapter("good", str(tiny_adapters["attn-r4"]))
    broken = tmp_path / "broken"
    shutil.copytree(tiny_adapters["mlp-r8"], broken)
    weights = broken / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated
    with pytest.raises(errors.InvalidAdapter):
        ops.load_adapter("broken", str(broken))
    config = json.loads((broken / "adapter_config.json").read_text())
    assert config["r"] == 8
    _still_serves(engine, "good")
    assert [s.name for s in ops.list_adapters()] == ["good"]


def test_concurrent_submissions_from_many_threads_all_complete(
    engine_factory: EngineFactory,
) -> None:
    engine = engine_factory()
    results: list[int] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        tokens, _ = _tokens(engine.submit("tiny", _prompt(i % 3), SamplingParams(
            max_tokens=8, ignore_eos=True)))
        with lock:
            results.append(len(tokens))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [8] * 16
