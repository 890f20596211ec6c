"""The embedded default model (SmolLM2-135M-Instruct) through the engine, against transformers +
PEFT: a mixed batch of adapters and the base model, greedy tokens identical; then one sample
adapter of every kind the worker serves (DoRA, new tokens, vocabulary LoRAs, saved modules,
activated LoRA), trained by scripts/train_sample_adapters.py, in one batch and alone."""

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
from tests.support.engine_rounds import two_rounds_match
from tests.support.sample_script import load_script
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



# -- one adapter of each kind, trained by scripts/train_sample_adapters.py ---------------------
SAMPLES = Path(__file__).resolve().parents[3] / "lorastream" / "samples" / "adapters"
# The samples (lorastream/samples/README.md), each trained by the script with --kind; the plain
# LoRA is `french`. A saved lm_head (~56 MB) is not committed: the fixture trains it (2 steps).
KIND_SAMPLES = {
    "french": "french", "dora": "french-dora", "tokens": "french-tokens",
    "embed-lora": "french-embed-lora", "head-lora": "french-head-lora", "alora": "french-alora",
}
SAVED = "saved-modules"
KIND_QUESTIONS = ("What is the capital of Italy?", "Tell me about dogs.")  # held out of training
KIND_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def kind_adapters(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("kind-adapters")
    script = load_script()
    args = ["--model", str(checkpoint), "--out", str(out), "--which", "french", "--kind", SAVED,
            "--steps", "2", "--warmup-steps", "1", "--examples", "16", "--sample-tokens", "1",
            "--rank", "4"]
    assert script.main(args) == 0
    return {**{name: SAMPLES / folder for name, folder in KIND_SAMPLES.items()},
            SAVED: out / f"french-{SAVED}"}


@pytest.fixture(scope="module")
def kind_prompts(checkpoint: Path) -> list[list[int]]:
    """Per question, the prompts the script trains each kind on: the chat prompt, the prompt
    with the tokens sample's cue, the prompt that invokes the alora sample."""
    from transformers import AutoTokenizer

    script, tokenizer = load_script(), AutoTokenizer.from_pretrained(checkpoint)
    return [script.kind_prompt_ids(tokenizer, q, kind)
            for q in KIND_QUESTIONS for kind in ("plain", "tokens", "alora")]


@pytest.fixture(scope="module")
def kind_reference(
    checkpoint: Path, kind_adapters: dict[str, Path], kind_prompts: list[list[int]]
) -> dict[tuple[str, int], list[int]]:
    """(name or "default", prompt index) -> transformers + PEFT greedy tokens, each adapter
    loaded in PEFT on its own."""
    reference = {}
    for name in ["default", *kind_adapters]:
        model = peft_model(checkpoint, kind_adapters.get(name))
        for i, prompt in enumerate(kind_prompts):
            reference[(name, i)] = reference_greedy(model, prompt, KIND_NEW_TOKENS)
    return reference


@pytest.mark.slow  # minutes on 2 shared cores: 8 PEFT references, a 2-step training, 2 engines
@pytest.mark.timeout(1200)  # the fixtures' time counts too
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-cache"])
def test_one_sample_of_each_kind_serves_as_peft_alone_and_in_one_mixed_batch(
    checkpoint: Path, kind_adapters: dict[str, Path], kind_prompts: list[list[int]],
    kind_reference: dict[tuple[str, int], list[int]], prefix_caching: bool,
    tmp_path: Path,
) -> None:
    """DoRA, new token rows, LoRA on embed_tokens and on lm_head, a saved lm_head and an
    activated LoRA, trained on the default model, with the plain `french` and the base model:
    every (model, prompt) in one batch, twice (the second round from the prefix cache where it
    is on), then each adapter alone; every request's greedy tokens are PEFT's."""
    settings = WorkerSettings(
        model="default", max_loras=len(kind_adapters), max_lora_rank=8,
        kv_cache_bytes=64 << 20, model_cache_dir=tmp_path, prefix_caching=prefix_caching,
    )
    engine = build_engine(settings, checkpoint=checkpoint)
    try:
        ops = WorkerOperations(engine)
        for name, path in kind_adapters.items():
            ops.load_adapter(name, str(path))
        cached = two_rounds_match(engine, ["default", *kind_adapters], kind_prompts,
                                  KIND_NEW_TOKENS, kind_reference, "mixed")
        assert (max(cached.values()) > 0) is prefix_caching
        for name in kind_adapters:
            streams = [engine.submit(name, PromptInput(token_ids=tuple(p)),
                                     SamplingParams(max_tokens=KIND_NEW_TOKENS))
                       for p in kind_prompts]
            for i, stream in enumerate(streams):
                tokens = [t for e in stream for t in e.token_ids]
                assert tokens == kind_reference[(name, i)], (name, i, "alone")
    finally:
        engine.stop()
    for name in kind_adapters:  # each adapter changes the tokens: the comparison proves something
        assert any(kind_reference[(name, i)] != kind_reference[("default", i)]
                   for i in range(len(kind_prompts))), name
