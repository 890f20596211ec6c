"""``--model model.gguf`` of a mixture-of-experts model (``lorastream/worker/model/gguf_moe.py``):
a tiny Qwen3-MoE, Mixtral or Qwen2-MoE (shared expert, q/k/v biases, tied embeddings)
checkpoint written as llama.cpp lays it out (experts stacked in
``ffn_*_exps``, or one tensor per expert as older Mixtral files have them; Mixtral's q/k rows
permuted), F32, with gguf's own writer. The converted checkpoint holds exactly the source
checkpoint's weights, and the worker serving the file gives transformers' greedy tokens on the
source checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorastream.core.generation import PromptInput, SamplingParams
from lorastream.worker.model.checkpoint import resolve_checkpoint
from lorastream.worker.model.embedded import embedded_gguf_path
from lorastream.worker.service.bootstrap import build_engine
from lorastream.worker.service.config import WorkerSettings
from tests.support.families import NEW_TOKENS, PROMPTS
from tests.support.gguf_files import write_moe_gguf
from tests.support.models import make_tiny_family
from tests.worker.conftest import reference_greedy

VOCAB = 49152  # the embedded GGUF's tokenizer, whose metadata the file carries
# What llama.cpp's MoE layouts cannot express: a dense layer among the sparse ones (Qwen3-MoE
# ``mlp_only_layers``) and a sliding window.
GGUF_EXPRESSIBLE = {"qwen3_moe": dict(mlp_only_layers=[], use_sliding_window=False),
                    "mixtral": dict(sliding_window=None),
                    "qwen2_moe": dict(use_sliding_window=False)}
CASES = [("qwen3_moe", "stacked"), ("mixtral", "stacked"), ("mixtral", "per-expert"),
         ("qwen2_moe", "stacked")]


@pytest.fixture(scope="module", params=CASES, ids=["-".join(c) for c in CASES])
def files(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(source checkpoint, its GGUF file, the model cache the file is converted into)."""
    family, layout = request.param
    root = tmp_path_factory.mktemp(f"{family}-{layout}")
    source = make_tiny_family(family, root / "source", vocab_size=VOCAB,
                              **GGUF_EXPRESSIBLE[family])  # type: ignore[arg-type]  # config keywords
    gguf = write_moe_gguf(source, embedded_gguf_path(), root / f"tiny-{family}.gguf",
                          per_expert=layout == "per-expert")
    return source, gguf, root / "models"


def test_the_converted_checkpoint_holds_the_source_checkpoints_weights(
        files: tuple[Path, Path, Path]) -> None:
    from safetensors.torch import load_file

    source, gguf, cache = files
    converted = resolve_checkpoint(str(gguf), cache_dir=cache)
    want = load_file(str(source / "model.safetensors"))
    got = load_file(str(converted / "model.safetensors"))
    assert got.keys() == want.keys()
    assert any(".experts." in key for key in want)
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key


def test_the_worker_serving_the_file_gives_transformers_greedy_tokens(
        files: tuple[Path, Path, Path]) -> None:
    from transformers import AutoModelForCausalLM

    source, gguf, cache = files
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    engine = build_engine(WorkerSettings(
        model=str(gguf), served_model_name="tiny-gguf", model_cache_dir=cache, max_loras=2,
        max_lora_rank=8, kv_cache_bytes=8 << 20)).start()
    try:
        assert engine.model.config.is_moe
        for prompt in PROMPTS:
            expected = reference_greedy(hf, prompt, NEW_TOKENS)
            stream = engine.submit("tiny-gguf", PromptInput(token_ids=tuple(prompt)),
                                   SamplingParams(max_tokens=NEW_TOKENS))
            assert [t for event in stream for t in event.token_ids] == expected
    finally:
        engine.stop()
