"""The embedded default model (SmolLM2-135M-Instruct) through the engine, against transformers +
PEFT: a mixed batch of adapters and the base model, greedy tokens identical."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorastream.bench.synthetic import ALL_LINEAR, SMOLLM2_135M, make_synthetic_adapter
from lorastream.core.generation import PromptInput, SamplingParams
from lorastream.worker.engine.engine import Engine
from lorastream.worker.model.checkpoint import resolve_checkpoint
from lorastream.worker.service.bootstrap import build_engine
from lorastream.worker.service.config import WorkerSettings
from lorastream.worker.service.operations import WorkerOperations
from tests.worker.conftest import peft_model, reference_greedy

# Shared with test_checkpoint.py: the conversion (~35 s) happens once per machine.
DEFAULT_MODEL_CACHE = Path.home() / ".cache" / "lorastream" / "test-models"
QUESTIONS = ("What is the capital of France?", "Name a primary colour.", "Say hello in Spanish.")
ADAPTERS = {
    "all-r8": dict(rank=8, targets=ALL_LINEAR, seed=1),
    "attn-r4": dict(rank=4, targets=("q_proj", "k_proj", "v_proj", "o_proj"), seed=2),
    "mlp-r16": dict(rank=16, targets=("gate_proj", "up_proj", "down_proj"), seed=3),
}
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    return resolve_checkpoint("default", cache_dir=DEFAULT_MODEL_CACHE)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("default-adapters")
    return {
        name: make_synthetic_adapter(root / name, SMOLLM2_135M, std=0.05, **spec)  # type: ignore[arg-type]  # spec: the function's own keywords
        for name, spec in ADAPTERS.items()
    }


@pytest.fixture(scope="module")
def engine(checkpoint: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    settings = WorkerSettings(
        model="default", max_loras=4, max_lora_rank=16, kv_cache_bytes=64 << 20,
        model_cache_dir=tmp_path_factory.mktemp("unused-cache"),
    )
    engine = build_engine(settings, checkpoint=checkpoint)
    ops = WorkerOperations(engine)
    for name, path in adapters.items():
        ops.load_adapter(name, str(path))
    yield engine
    engine.stop()


def test_a_mixed_batch_on_the_default_model_matches_transformers_and_peft(
    engine: Engine, checkpoint: Path, adapters: dict[str, Path]
) -> None:
    prompts = [
        engine.tokenize(PromptInput(messages=(("user", q),))) for q in QUESTIONS
    ]
    streams = {
        (name, i): engine.submit(name, PromptInput(token_ids=tuple(p)),
                                 SamplingParams(max_tokens=NEW_TOKENS))
        for name in ["default", *ADAPTERS]
        for i, p in enumerate(prompts)
    }
    engine.start()  # everything lands in one batch
    ours = {key: [t for e in stream for t in e.token_ids] for key, stream in streams.items()}
    assert engine.stats.peak_running == len(streams)
    for name in ["default", *ADAPTERS]:
        model = peft_model(checkpoint, None if name == "default" else adapters[name])
        for i, prompt in enumerate(prompts):
            assert ours[(name, i)] == reference_greedy(model, prompt, NEW_TOKENS), (name, i)
    for name in ADAPTERS:  # the adapters change the answers: the comparison proves something
        assert any(ours[(name, i)] != ours[("default", i)] for i in range(len(prompts)))
    answer = engine.tokenizer.decode(ours[("default", 0)])
    assert "Paris" in answer

