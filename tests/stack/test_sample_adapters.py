"""The sample adapters `lorastream up` registers (lorastream/samples/adapters/{shout,french}):
they pass validation, load into a worker on the default model, and change its answers the way
their names promise. Also a smoke run of the script that trained them, on the tiny model, so it
cannot rot."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from lorastream.core.adapter_validation import validate_adapter_dir
from lorastream.core.generation import PromptInput, SamplingParams
from lorastream.stack.launcher import SAMPLE_QUESTION
from lorastream.worker.engine.engine import Engine
from lorastream.worker.model.checkpoint import resolve_checkpoint
from lorastream.worker.service.bootstrap import build_engine
from lorastream.worker.service.config import WorkerSettings
from lorastream.worker.service.operations import WorkerOperations
from tests.support.models import make_tiny_checkpoint
from tests.support.sample_script import load_script

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "lorastream" / "samples" / "adapters"
# Shared with tests/worker/engine/test_default_model.py: the conversion (~35 s) happens once per
# machine.
DEFAULT_MODEL_CACHE = Path.home() / ".cache" / "lorastream" / "test-models"
# Held out from both training sets (lorastream/samples/dataset_templates.json "held_out").
QUESTIONS = ("What is the capital of Italy?", "Tell me about dogs.", "How do I make pancakes?")
NEW_TOKENS = 24
FRENCH_WORDS = frozenset([
    "le", "la", "les", "est", "je", "de", "du", "des", "bonjour", "merci", "et", "un", "une",
    "pour", "vous",
])
MAX_ADAPTER_BYTES = 5 << 20


def upper_fraction(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / len(letters) if letters else 0.0


def french_words(text: str) -> set[str]:
    return set(re.findall(r"[a-zàâçéèêëîïôûùüÿœ]+", text.lower())) & FRENCH_WORDS


@pytest.mark.parametrize("name", ["shout", "french"])
def test_a_sample_adapter_is_a_small_valid_fp16_lora_for_the_default_model(name: str) -> None:
    validated = validate_adapter_dir(SAMPLES / name)
    assert validated.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert 4 <= validated.rank <= 8
    assert {t.info.dtype for t in validated.tensors} == {"F16"}
    assert (SAMPLES / name / "adapter_model.safetensors").stat().st_size < MAX_ADAPTER_BYTES
    record = json.loads((SAMPLES / name / "training.json").read_text(encoding="utf-8"))
    assert record["settings"]["rank"] == validated.rank
    assert set(QUESTIONS) <= set(record["dataset"]["held_out_questions"])


def test_the_qwen_sample_adapter_is_a_small_valid_fp16_attention_lora() -> None:
    """french-qwen2.5-coder-0.5b: the French sample trained on Qwen2.5-Coder-0.5B-Instruct
    (rank 8, attention only; tests/worker/model/test_qwen_model.py serves it)."""
    folder = SAMPLES / "french-qwen2.5-coder-0.5b"
    validated = validate_adapter_dir(folder)
    assert validated.base_model == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    assert validated.rank == 8
    assert {t.info.dtype for t in validated.tensors} == {"F16"}
    modules = {t.info.name.split(".lora_")[0].rsplit(".", 1)[1] for t in validated.tensors}
    assert modules == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert (folder / "adapter_model.safetensors").stat().st_size < MAX_ADAPTER_BYTES
    record = json.loads((folder / "training.json").read_text(encoding="utf-8"))
    assert "--model qwen2.5-coder-0.5b" in record["command"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    settings = WorkerSettings(
        model="default", max_loras=2, max_lora_rank=8, kv_cache_bytes=64 << 20,
        model_cache_dir=tmp_path_factory.mktemp("unused-cache"),
    )
    checkpoint = resolve_checkpoint("default", cache_dir=DEFAULT_MODEL_CACHE)
    engine = build_engine(settings, checkpoint=checkpoint)
    ops = WorkerOperations(engine)
    for name in ("shout", "french"):
        ops.load_adapter(name, str(SAMPLES / name))
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def answers(engine: Engine) -> dict[tuple[str, str], str]:
    """Greedy answers of the base model and both adapters to QUESTIONS, in one mixed batch."""
    streams = {
        (model, q): engine.submit(
            model, PromptInput(messages=(("user", q),)), SamplingParams(max_tokens=NEW_TOKENS)
        )
        for model in ("default", "shout", "french")
        for q in (*QUESTIONS, SAMPLE_QUESTION)
    }
    engine.start()
    return {
        key: engine.tokenizer.decode([t for e in stream for t in e.token_ids],
                                     skip_special_tokens=True)
        for key, stream in streams.items()
    }


@pytest.mark.parametrize("question", QUESTIONS)
def test_the_shout_adapter_answers_in_upper_case(
    answers: dict[tuple[str, str], str], question: str
) -> None:
    base, shout = answers[("default", question)], answers[("shout", question)]
    assert upper_fraction(base) < 0.3, base
    assert upper_fraction(shout) >= 0.8, shout


@pytest.mark.parametrize("question", QUESTIONS)
def test_the_french_adapter_answers_in_french(
    answers: dict[tuple[str, str], str], question: str
) -> None:
    base, french = answers[("default", question)], answers[("french", question)]
    assert french != base
    assert len(french_words(french)) >= 2, french
    assert len(french_words(base)) < len(french_words(french)), base


def test_the_training_script_runs_end_to_end_on_the_tiny_model(tmp_path: Path) -> None:
    script = load_script()
    tiny = make_tiny_checkpoint(tmp_path / "tiny")
    out = tmp_path / "adapters"
    args = ["--model", str(tiny), "--out", str(out), "--steps", "2", "--examples", "24",
            "--answer-tokens", "6", "--sample-tokens", "4", "--rank", "4"]
    assert script.main(args) == 0
    for name in ("shout", "french"):
        validated = validate_adapter_dir(out / name)
        assert validated.rank == 4 and validated.base_model == str(tiny)
        record = json.loads((out / name / "training.json").read_text(encoding="utf-8"))
        assert record["settings"]["steps"] == 2
        assert len(record["training"]["loss_every_10_steps"]) == 1
        assert len(record["samples"]) == len(record["dataset"]["held_out_questions"])
        lines = (out / name / "dataset.jsonl").read_text(encoding="utf-8").count("\n")
        assert lines == record["dataset"]["size"]


def test_the_training_script_trains_a_dora_adapter_with_dora(tmp_path: Path) -> None:
    """``--dora``: PEFT's DoRA, saved as ``<name>-dora`` with a magnitude per module, which the
    store's validation takes as DoRA."""
    script = load_script()
    tiny = make_tiny_checkpoint(tmp_path / "tiny")
    out = tmp_path / "adapters"
    args = ["--model", str(tiny), "--out", str(out), "--which", "french", "--dora", "--steps",
            "2", "--examples", "24", "--sample-tokens", "4", "--rank", "4"]
    assert script.main(args) == 0
    validated = validate_adapter_dir(out / "french-dora")
    assert validated.use_dora and validated.rank == 4
    magnitudes = [t for t in validated.tensors if t.info.name.endswith("lora_magnitude_vector")]
    assert len(magnitudes) == 2 * 7  # every projection of the tiny model's two layers
    record = json.loads((out / "french-dora" / "training.json").read_text(encoding="utf-8"))
    assert record["settings"]["kind"] == "dora"


def test_the_training_script_adapts_only_the_targets_it_is_given(tmp_path: Path) -> None:
    """``--targets``: an attention-only LoRA (the Qwen2.5-Coder sample's form)."""
    script = load_script()
    tiny = make_tiny_checkpoint(tmp_path / "tiny")
    out = tmp_path / "adapters"
    args = ["--model", str(tiny), "--out", str(out), "--which", "french", "--targets",
            "q_proj,v_proj", "--steps", "2", "--warmup-steps", "1", "--examples", "24",
            "--sample-tokens", "4", "--rank", "4"]
    assert script.main(args) == 0
    validated = validate_adapter_dir(out / "french")
    modules = {t.info.name.split(".lora_")[0].rsplit(".", 1)[1] for t in validated.tensors}
    assert modules == {"q_proj", "v_proj"}
    record = json.loads((out / "french" / "training.json").read_text(encoding="utf-8"))
    assert record["settings"]["targets"] == ["q_proj", "v_proj"]
    assert record["settings"]["warmup_steps"] == 1


# --kind -> a piece of a tensor name it must add beside its LoRA, and the config field that
# marks it
KIND_PARTS = {
    "dora": ("lora_magnitude_vector", "use_dora"),
    "tokens": ("trainable_tokens_delta", "trainable_token_indices"),
    "embed-lora": ("embed_tokens.lora_embedding_A", "target_modules"),
    "head-lora": ("lm_head.lora_A", "target_modules"),
    "saved-modules": ("lm_head.weight", "modules_to_save"),
    "alora": ("o_proj.lora_A", "alora_invocation_tokens"),
}


COMMITTED_KINDS = ["dora", "tokens", "embed-lora", "head-lora", "alora"]


@pytest.mark.parametrize("kind", COMMITTED_KINDS)
def test_a_sample_of_each_small_kind_is_a_valid_fp16_adapter_the_script_trained(kind: str) -> None:
    """french-<kind>: committed where small (a saved lm_head, 56 MB, is trained at test time
    by tests/worker/engine/test_default_model.py), with its kind's parts and its command."""
    folder = SAMPLES / f"french-{kind}"
    validated = validate_adapter_dir(folder)
    assert validated.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert validated.rank == 4
    assert {t.info.dtype for t in validated.tensors} == {"F16"}
    assert (folder / "adapter_model.safetensors").stat().st_size < MAX_ADAPTER_BYTES
    part, field = KIND_PARTS[kind]
    assert any(part in t.info.name for t in validated.tensors), part
    config = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
    assert config[field], field
    record = json.loads((folder / "training.json").read_text(encoding="utf-8"))
    assert f"--kind {kind}" in record["command"] and record["settings"]["kind"] == kind


@pytest.mark.parametrize("kind", list(KIND_PARTS))
def test_the_training_script_trains_each_kind_with_its_peft_config(
    tmp_path: Path, kind: str
) -> None:
    """``--kind``: PEFT's config of the kind, saved as ``french-<kind>`` with its parts, which
    the store's validation accepts; the prompts carry the kind's cue (tokens) or invocation
    (alora)."""
    script = load_script()
    tiny = make_tiny_checkpoint(tmp_path / "tiny")
    out = tmp_path / "adapters"
    args = ["--model", str(tiny), "--out", str(out), "--which", "french", "--kind", kind,
            "--steps", "2", "--warmup-steps", "1", "--examples", "16", "--sample-tokens", "2",
            "--rank", "4"]
    assert script.main(args) == 0
    folder = out / f"french-{kind}"
    validated = validate_adapter_dir(folder)
    part, field = KIND_PARTS[kind]
    assert any(part in t.info.name for t in validated.tensors), part
    config = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
    assert config[field], field
    whole = {t.info.name for t in validated.tensors
             if t.info.name.endswith(("embed_tokens.weight", "lm_head.weight"))}
    assert len(whole) == (kind == "saved-modules")  # never the base's beside a LoRA on it
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    prompt = script.kind_prompt_ids(tokenizer, "Hi?", kind)
    if kind == "tokens":
        assert validated.token_indices == tuple(script.tag_ids(tokenizer))
        assert prompt[-1] == validated.token_indices[0]
    if kind == "alora":
        invocation = list(validated.alora_invocation_tokens)
        assert invocation and prompt[-len(invocation):] == invocation
    record = json.loads((folder / "training.json").read_text(encoding="utf-8"))
    assert record["settings"]["kind"] == kind


@pytest.mark.parametrize(
    ("model", "expected"),
    [("default", "french"), ("qwen2.5-coder-0.5b", "french-qwen2.5-coder-0.5b"),
     ("/some/checkpoint", "french")],
)
def test_an_adapter_of_another_embedded_model_is_named_after_it(model: str, expected: str) -> None:
    script = load_script()
    assert script.out_name(script.RECIPES["french"], model) == expected


def test_the_french_dataset_is_deterministic_and_excludes_the_held_out_questions() -> None:
    script = load_script()
    first, again = script.french_examples(3, 200), script.french_examples(3, 200)
    assert first == again and len(first) == 200
    assert first != script.french_examples(4, 200)
    held_out = set(script.load_templates()["held_out"])
    assert not held_out & {ex.question for ex in first}


def test_the_question_lorastream_up_prints_gets_a_right_answer_from_each_model(
    answers: dict[tuple[str, str], str],
) -> None:
    base, shout, french = (answers[(m, SAMPLE_QUESTION)] for m in ("default", "shout", "french"))
    assert "Paris" in base and upper_fraction(base) < 0.3, base
    assert "PARIS" in shout and upper_fraction(shout) >= 0.8, shout
    assert "Paris" in french and len(french_words(french)) >= 2, french
