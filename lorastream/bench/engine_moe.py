"""Decode throughput on a mixture-of-experts base: the engine with many expert-LoRA adapters,
the engine with the base model only, and HF transformers + PEFT, on the same prompts in one
process (``lorastream bench engine --model <a MoE checkpoint>``; ``engine.py`` sends MoE bases
here).

Every adapter is PEFT's fused form as transformers 5 trains it: ``target_parameters`` on
``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj`` of every sparse layer, plus LoRA on
q/k/v/o (random A and B, B non-zero; ``expert_lora.py``). Decode tok/s is measured as in
``decode_rate.py``.

PEFT 0.21 refuses mixed-adapter batches with LoRA on expert parameters (``lora.ParamWrapper
does not support mixed adapter batches yet``), so the peer serves the same prompts adapter by
adapter: ``set_adapter``, then one batched ``generate`` over that adapter's prompts -- what a
PEFT deployment of such adapters can do. PEFT is slow with LoRA on the experts (each forward
builds the whole parameter's delta, every expert's), so its side may generate fewer tokens per
prompt (``--peft-new-tokens``, recorded as ``peft_new_tokens``): decode tok/s is per token, as
``decode_rate.py`` measures it, either way.

:func:`make_moe_checkpoint` writes the random-weight Qwen3-MoE base these figures are measured
on (``lorastream bench moe-checkpoint``), with the default model's tokenizer.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lorastream.bench.decode_rate import QUESTIONS, decode_rates
from lorastream.bench.expert_lora import write_expert_lora
from lorastream.bench.machine import command_line, machine_info
from lorastream.core.adapter_format import WEIGHTS_FILE
from lorastream.core.generation import PromptInput, SamplingParams


@dataclass(frozen=True)
class MoeShape:
    """A Qwen3-MoE shape (every layer sparse). The default is Qwen3-30B-A3B's proportions
    scaled down to fit a small machine: many experts, top-8, ``moe_intermediate / hidden`` of
    768 / 2048, 8 query heads per KV head -- hidden 1024 (2048), 4 layers (48), 64 experts
    (128), the same top-8 and expert width ratio. Its expert LoRA weights (rank 16) are a
    small part of the experts' own, as in the real model."""

    hidden: int = 1024
    layers: int = 4
    heads: int = 16
    kv_heads: int = 2
    head_dim: int = 64
    experts: int = 64
    top_k: int = 8
    moe_intermediate: int = 384

    def config(self, vocab_size: int) -> dict[str, Any]:
        """Keyword arguments of transformers' ``Qwen3MoeConfig``."""
        return dict(
            vocab_size=vocab_size, hidden_size=self.hidden, num_hidden_layers=self.layers,
            num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim, intermediate_size=4 * self.moe_intermediate,
            num_experts=self.experts, num_experts_per_tok=self.top_k,
            moe_intermediate_size=self.moe_intermediate, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
            max_position_embeddings=40960,  # Qwen3-30B-A3B's
        )


def read_ceiling(
    config: Any, adapters: int, rank: int, prompts: int, element_bytes: int = 4
) -> dict[str, object]:
    """The bytes one decode step of ``prompts`` rows reads, base model only and with one adapter
    per row (``adapters`` of them, rows spread evenly), and so the best multi-adapter / base
    ratio a memory-bound step can reach: ``base / (base + adapter)``.

    Base: each layer's attention and router matrices, every expert some row visits (uniform
    routing: ``E (1 - (1 - k/E)^T)`` experts of ``3 H I`` weights) and the LM head. Adapters:
    each distinct adapter's attention A and B, and, per expert its rows visit, that expert's A
    and B as the adapter holds them (gate_up's A once: PEFT's fused form shares it between gate
    and up; the engine's storage holds it twice, ``engine_adapter_step_mb``). The KV cache,
    norms and embedding rows are left out (small beside these at short contexts). ``layers_*``:
    the decoder layers alone, without the LM head (which a real 48-layer model reads 48 times
    less of, per layer, than this shape)."""
    h, i, e, k = (config.hidden_size, config.moe_intermediate_size, config.num_experts,
                  config.experts_per_token)
    q, kv = config.q_size, config.kv_size
    distinct = min(adapters, prompts)
    rows_each = prompts / distinct

    def visited(rows: float) -> float:  # expected experts some of ``rows`` rows route to
        return e * (1 - (1 - k / e) ** rows)

    moe_layers = sum(config.is_moe_layer(layer) for layer in range(config.num_layers))
    attention = h * q + 2 * h * kv + q * h
    base_layers = (config.num_layers * attention
                   + moe_layers * (e * h + visited(prompts) * 3 * h * i))
    head = config.vocab_size * h
    attention_lora = rank * ((h + q) + 2 * (h + kv) + (q + h))
    expert_lora = rank * (h + 2 * i + i + h)  # A_gu, B_gu, A_down, B_down
    engine_expert_lora = expert_lora + rank * h  # gate_up's A stored for gate and for up
    per_adapter = config.num_layers * attention_lora
    adapter = distinct * (per_adapter + moe_layers * visited(rows_each) * expert_lora)
    engine = distinct * (per_adapter + moe_layers * visited(rows_each) * engine_expert_lora)

    def mb(weights: float) -> float:
        return round(weights * element_bytes / 1e6, 1)

    return {
        "experts_visited_per_layer": round(visited(prompts), 1),
        "base_step_mb": mb(base_layers + head),
        "adapter_step_mb": mb(adapter),
        "engine_adapter_step_mb": mb(engine),
        "multi_vs_base_ceiling": round((base_layers + head) / (base_layers + head + adapter), 3),
        "layers_base_mb": mb(base_layers),
        "layers_multi_vs_base_ceiling": round(base_layers / (base_layers + adapter), 3),
    }


def make_moe_checkpoint(out_dir: Path, shape: MoeShape = MoeShape(), seed: int = 0) -> Path:
    """A random-weight Qwen3-MoE checkpoint (fp32 safetensors, transformers 5's fused experts)
    with the default model's tokenizer and chat template; the router's weights are widened so
    that tokens spread over the experts."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from lorastream.bench.synthetic import resolve_model_checkpoint

    tokenizer_dir = resolve_model_checkpoint("default")
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**shape.config(vocab))).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


def peft_by_adapter_rate(
    checkpoint: Path, dirs: list[Path], prompts: list[list[int]], new_tokens: int, repeats: int
) -> float:
    """HF transformers + PEFT, every adapter loaded; each adapter's prompts in one ``generate``
    after ``set_adapter`` (mixed batches are refused for expert LoRA: module docstring)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lorastream.bench.peft_peer import left_padded, pad_token

    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, dirs[0], adapter_name="a0")
    for i, path in enumerate(dirs[1:], start=1):
        model.load_adapter(path, adapter_name=f"a{i}")
    model.eval()
    pad = pad_token(base.config)
    groups = [
        left_padded([p for j, p in enumerate(prompts) if j % len(dirs) == a], pad)
        for a in range(min(len(dirs), len(prompts)))
    ]

    def run(n: int) -> None:
        with torch.no_grad():
            for a, (input_ids, mask) in enumerate(groups):
                model.set_adapter(f"a{a}")
                model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=n,
                               min_new_tokens=n, do_sample=False, pad_token_id=pad)

    return decode_rates([run], len(prompts), new_tokens, repeats)[0]


def run_moe_engine_bench(
    model: str, checkpoint: Path, adapters: int = 32, rank: int = 16, prompts: int = 32,
    new_tokens: int = 32, repeats: int = 3, include_peft: bool = True,
    peft_new_tokens: int | None = None,
) -> dict[str, object]:
    """The figures of the module docstring, as a result dict (``benchmark: engine_moe``);
    ``peft_new_tokens``: the PEFT side's tokens per prompt (None: ``new_tokens``)."""
    peft_new_tokens = peft_new_tokens or new_tokens
    from lorastream.worker.model.config import ModelConfig
    from lorastream.worker.service.bootstrap import build_engine
    from lorastream.worker.service.config import WorkerSettings
    from lorastream.worker.service.operations import WorkerOperations

    load_before = os.getloadavg()[0]  # the machine is shared: its load goes with the figures
    config = ModelConfig.from_dir(checkpoint)
    settings = WorkerSettings(
        model=model, served_model_name="base", max_loras=adapters, max_lora_rank=rank,
        max_batch_size=prompts, max_num_tokens=max(512, prompts * 64), kv_cache_bytes=1 << 29,
    )
    with tempfile.TemporaryDirectory(prefix="lorastream-bench-moe-") as tmp:
        dirs = [write_expert_lora(Path(tmp) / f"a{i}", config, rank, seed=i)
                for i in range(adapters)]
        adapter_bytes = sum(p.stat().st_size for p in (dirs[0] / WEIGHTS_FILE,))
        engine = build_engine(settings, checkpoint=checkpoint)
        chat = getattr(engine.tokenizer, "chat_template", None) is not None
        ids = [
            tuple(engine.tokenize(
                PromptInput(messages=(("user", q),)) if chat else PromptInput(text=q)))
            for q in (QUESTIONS[i % len(QUESTIONS)] for i in range(prompts))
        ]

        def measure() -> list[float]:
            ops = WorkerOperations(engine)
            for i, path in enumerate(dirs):
                ops.load_adapter(f"a{i}", str(path))

            def engine_run(models: list[str]) -> Any:
                def run(n: int) -> None:
                    params = SamplingParams(max_tokens=n, ignore_eos=True)
                    streams = [engine.submit(m, PromptInput(token_ids=p), params)
                               for m, p in zip(models, ids, strict=True)]
                    for stream in streams:
                        for _ in stream:
                            pass

                return run

            return decode_rates([engine_run([f"a{i % adapters}" for i in range(prompts)]),
                                 engine_run(["base"] * prompts)], prompts, new_tokens, repeats)

        multi, base = engine.run_while(measure)
        slot_bytes = {"projections": engine.slots.nbytes - engine.slots.expert_nbytes,
                      "experts": engine.slots.expert_nbytes}
        engine.stop()
        peft = (peft_by_adapter_rate(checkpoint, dirs, [list(p) for p in ids],
                                     peft_new_tokens, repeats) if include_peft else None)
    result: dict[str, object] = {
        "benchmark": "engine_moe",
        "command": command_line(),
        "model": model,
        "shape": {"family": config.family, "hidden": config.hidden_size,
                  "layers": config.num_layers, "heads": config.num_heads,
                  "kv_heads": config.num_kv_heads, "head_dim": config.head_dim,
                  "experts": config.num_experts,
                  "top_k": config.experts_per_token,
                  "moe_intermediate": config.moe_intermediate_size},
        "adapters": adapters,
        "rank": rank,
        "read_ceiling": read_ceiling(config, adapters, rank, prompts),
        "targets": "q/k/v/o + experts (target_parameters gate_up_proj, down_proj)",
        "adapter_file_mb": round(adapter_bytes / 1e6, 1),
        "slot_bytes_mb": {k: round(v / 1e6, 1) for k, v in slot_bytes.items()},
        "prompts": prompts,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "engine_multi_adapter_decode_tok_s": round(multi, 1),
        "engine_base_only_decode_tok_s": round(base, 1),
        "multi_vs_base": round(multi / base, 3),
        "goal_multi_vs_base": ">= 0.7",
    }
    if peft is not None:
        result |= {
            "peft_by_adapter_decode_tok_s": round(peft, 1),
            "peft_new_tokens": peft_new_tokens,
            "multi_vs_peft": round(multi / peft, 2),
            "goal_multi_vs_peft": ">= 3",
        }
    result["load_avg_1m"] = {"before": round(load_before, 2),
                             "after": round(os.getloadavg()[0], 2)}
    result["machine"] = machine_info()
    return result
