"""The GPU benchmarks' random-weight models (``lorastream/bench/gpu_model.py``), on the CPU:

- a shape's random weights have exactly the tensors, shapes and dtypes the worker reads from a
  transformers checkpoint of the same config.json (so the engine runs them as it runs the real
  model), Llama's layout and Qwen3-MoE's;
- the MoE router spreads tokens over the experts, and the engine decodes over the random MoE
  weights with the base model and expert-LoRA adapters in one batch;
- a family or a detail the builder cannot make is refused, not built wrong.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from lorastream.bench.gpu_model import (
    SHAPES,
    make_adapters,
    model_config,
    random_engine,
    random_model,
    random_weights,
)
from lorastream.core.generation import PromptInput, SamplingParams
from lorastream.worker.model.config import ModelConfig
from lorastream.worker.model.weights import load_weights
from lorastream.worker.service.operations import WorkerOperations

CPU = torch.device("cpu")


def _transformers_checkpoint(shape: str, out: Path) -> Path:
    """A random checkpoint that transformers builds and saves from the shape's config.json."""
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = dict(SHAPES[shape])
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    AutoModelForCausalLM.from_config(config).save_pretrained(out, safe_serialization=True)
    return out


def _tensors(value: Any, prefix: str = "") -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor inside a weights dataclass (nested, lists too) -> (shape, dtype)."""
    if isinstance(value, torch.Tensor):
        return {prefix: (tuple(value.shape), value.dtype)}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in
                _tensors(item, f"{prefix}[{i}]").items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: v for f in dataclasses.fields(value) for k, v in
                _tensors(getattr(value, f.name), f"{prefix}.{f.name}").items()}
    return {}


@pytest.mark.parametrize("shape", ["tiny", "tiny-moe"])
def test_random_weights_have_the_tensors_the_worker_reads_from_a_checkpoint(
    shape: str, tmp_path: Path
) -> None:
    checkpoint = _transformers_checkpoint(shape, tmp_path / shape)
    config = ModelConfig.from_dir(checkpoint)
    ids = {"name": "", "bos_token_id": None, "eos_token_ids": ()}  # transformers' defaults
    assert dataclasses.replace(config, **ids) == dataclasses.replace(model_config(shape), **ids)
    loaded = _tensors(load_weights(checkpoint, config, torch.float32, CPU))
    made = _tensors(random_weights(model_config(shape), torch.float32, CPU))
    assert made == loaded
    if shape == "tiny-moe":  # the MoE parts are there: router, fused experts, q/k norms
        assert made[".layers[1].moe.gate_up"] == ((8, 64, 64), torch.float32)
        assert made[".layers[0].q_norm"] == ((16,), torch.float32)


def test_the_random_router_spreads_tokens_over_every_expert() -> None:
    model = random_model(model_config("tiny-moe"), torch.float32, CPU)
    block = model.layers[0].moe
    assert block is not None
    h = model.layers[0].mlp_norm(torch.randn(64, 64, generator=torch.Generator().manual_seed(1)))
    _, experts = block.route(h)  # [64, 2]
    assert set(experts.flatten().tolist()) == set(range(8))


def test_the_engine_decodes_base_and_expert_adapters_together_on_random_moe_weights(
    tmp_path: Path,
) -> None:
    config = model_config("tiny-moe")
    dirs = make_adapters(tmp_path, config, 2, rank=4, dtype=torch.float32)
    engine = random_engine(random_model(config, torch.float32, CPU), max_loras=2,
                           max_lora_rank=4, host_cache_bytes=1 << 26, kv_cache_bytes=1 << 22,
                           max_batch_size=4, lora_backend="torch")
    ops = WorkerOperations(engine)
    for i, path in enumerate(dirs):
        ops.load_adapter(f"a{i}", str(path))
    tokens: dict[str, list[int]] = {}

    def run(name: str) -> None:
        params = SamplingParams(max_tokens=5, ignore_eos=True)
        tokens[name] = [t for event in engine.submit(name, PromptInput(token_ids=(3, 7, 11)),
                                                     params) for t in event.token_ids]

    def work() -> None:
        threads = [threading.Thread(target=run, args=(n,)) for n in ("base", "a0", "a1")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    engine.run_while(work)
    assert {name: len(ids) for name, ids in tokens.items()} == {"base": 5, "a0": 5, "a1": 5}
    assert all(0 <= t < config.vocab_size for ids in tokens.values() for t in ids)


@pytest.mark.parametrize(("shape", "change", "refused"), [
    ("tiny", {"family": "gemma2"}, "model_type 'gemma2'"),
    ("tiny", {"qkv_bias": True}, "projection biases"),
    ("tiny", {"qk_norm": True}, "q/k norms"),
    ("tiny-moe", {"shared_expert_intermediate_size": 32}, "shared expert"),
    ("tiny-moe", {"dense_layers": (0,)}, "dense layers"),
    ("tiny-moe", {"layer_windows": (8, 8)}, "sliding windows"),
])
def test_random_weights_refuse_what_they_cannot_build(
    shape: str, change: dict[str, Any], refused: str
) -> None:
    config = dataclasses.replace(model_config(shape), **change)
    with pytest.raises(ValueError, match=f"random weights are made for .*{refused}"):
        random_weights(config, torch.float32, CPU)
