"""Decode throughput: the engine with many adapters, the engine with the base model only, and
HF transformers + PEFT with mixed-adapter batches, on the same prompts in one process.

Decode tokens/s is measured the same way for all three, so prefill cost cancels out: every
prompt generates exactly ``new_tokens`` tokens (EOS ignored), the whole batch is timed once for
1 token and once for ``new_tokens`` tokens, and

    decode tok/s = prompts * (new_tokens - 1) / (t(new_tokens) - t(1))

Each figure is the best of ``repeats`` runs (the usual choice for throughput on a shared machine);
the engine sides take turns within every repeat.

A mixture-of-experts base runs ``engine_moe.py`` instead (expert LoRAs, PEFT adapter by
adapter).

With ``dora``, a third engine side runs DoRA adapters with the same A and B as the plain ones
(same modules, rank and seeds, plus magnitudes) on the same prompts: ``dora_vs_lora`` is DoRA's
decode tok/s over the plain LoRAs' in the same run (goal >= 0.9: the norm is taken when the
adapter is placed, not per step).

With ``tokens`` (k > 0), one more side runs the plain adapters each with k new embedding rows
(TrainableTokens, the same A and B): ``tokens_vs_lora`` is its decode tok/s over the plain
LoRAs' in the same run (goal >= 0.95).

With ``mix``, one more side runs every prompt as a weighted mix of two of the plain adapters
(prompt i: ``a{i}`` and ``a{i+1}``, 0.5 each; ``core/adapter_mix.py``), served from the plain
adapters' own slots: ``mix_vs_lora`` is its decode tok/s over the plain LoRAs' in the same run
(goal >= 0.8: each mix row reads two adapters).

With ``vocab`` (``synthetic.VOCAB_KINDS``), one more side per kind runs the plain adapters each
with that vocabulary module too: a LoRA of the same rank on ``embed_tokens`` or ``lm_head``, or a
whole saved ``embed_tokens`` or ``lm_head`` (``modules_to_save``). ``<kind>_vs_lora`` is its
decode tok/s over the plain LoRAs' in the same run; the issue sets no goal for these, the page
shows the cost. A saved module is a whole ``[V, H]`` matrix per adapter (113 MB at SmolLM2's
vocabulary in fp32), so the saved kinds' sides cycle over ``saved_adapters`` distinct adapters
(recorded), and their ratio is over one more side, the plain LoRAs cycling over as many
(``engine_saved_reference_decode_tok_s``: fewer distinct adapters read less LoRA per step); the
vocabulary budget (``--lora-vocab-bytes``) is sized to hold every side's.
"""

from __future__ import annotations

import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from lorastream.bench.decode_rate import QUESTIONS, decode_rates, peft_decode_rate
from lorastream.bench.machine import command_line, machine_info
from lorastream.bench.synthetic import (
    SMOLLM2_135M,
    VOCAB_KINDS,
    adapter_nbytes,
    checkpoint_shape,
    make_synthetic_adapter,
)
from lorastream.core.generation import PromptInput, SamplingParams

if TYPE_CHECKING:
    from lorastream.worker.lora.slots import LoraSlots

log = logging.getLogger(__name__)

def step_read_views(slots: LoraSlots, distinct: int) -> list[torch.Tensor]:
    """The weights a decode step over ``distinct`` adapters reads, layer by layer as the
    slot-major LoRA path reads them: the A and B of slots ``0 .. distinct-1`` at each layer (all
    of each slot's rank; the benchmark's adapters fill it)."""
    matrices = (*slots.a_groups.values(), *slots.b.values())  # [L, S, ...] each
    return [m[layer, :distinct] for m in matrices for layer in range(m.shape[0])]


def read_ms(views: list[torch.Tensor], samples: int = 15, pause_s: float = 0.2) -> list[float]:
    """Milliseconds to read every tensor of ``views`` once (a ``torch.sum`` each), ``samples``
    times ``pause_s`` apart on the calling thread: the fastest this machine moves those bytes,
    and how much that varies from moment to moment."""
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        for weights in views:
            weights.sum()
        times.append(round((time.perf_counter() - start) * 1000, 2))
        time.sleep(pause_s)
    return times


def run_engine_bench(
    model: str = "default",
    adapters: int = 32,
    rank: int = 16,
    prompts: int = 32,
    new_tokens: int = 32,
    repeats: int = 3,
    include_peft: bool = True,
    quantization: str = "none",
    dora: bool = False,
    tokens: int = 0,
    mix: bool = False,
    peft_new_tokens: int = 0,
    vocab: tuple[str, ...] = (),
    saved_adapters: int = 8,
) -> dict[str, object]:
    """``quantization``: "none", or quantized modes (comma-separated) to compare with the fp32 base
    instead (engine_quant.py); ``peft_new_tokens``: the PEFT side's tokens per prompt on a MoE
    base (0: ``new_tokens``); ``vocab``: vocabulary-module kinds, a side each."""
    if mix and adapters < 2:
        raise ValueError("--mix mixes two distinct adapters: use --adapters 2 or more")
    unknown = sorted(set(vocab) - set(VOCAB_KINDS))
    if unknown:
        raise ValueError(f"unknown --vocab kind {', '.join(unknown)}; known: "
                         f"{', '.join(VOCAB_KINDS)}")
    saved_adapters = min(adapters, saved_adapters)
    saved_kinds = {k for k in vocab if VOCAB_KINDS[k][1] == "modules_to_save"}
    vocab_adapters = {k: saved_adapters if k in saved_kinds else adapters for k in vocab}
    # fewer distinct adapters read less LoRA: the saved kinds compare with the plain LoRAs over
    # as many distinct adapters, in the same run
    saved_reference = bool(saved_kinds) and saved_adapters < adapters
    modes = [q for q in quantization.split(",") if q and q != "none"]
    if modes:
        from lorastream.bench.engine_quant import run_quant_bench

        return run_quant_bench(model, modes, adapters, rank, prompts, new_tokens, repeats,
                               include_peft)
    from lorastream.worker.model.checkpoint import resolve_checkpoint
    from lorastream.worker.model.config import ModelConfig
    from lorastream.worker.service.bootstrap import build_engine
    from lorastream.worker.service.config import WorkerSettings
    from lorastream.worker.service.operations import WorkerOperations

    checkpoint = resolve_checkpoint(model, cache_dir=WorkerSettings(model=model).model_cache_dir)
    config = ModelConfig.from_dir(checkpoint)
    vocab_bytes = sum(  # every vocab side's adapters resident at once, in fp32
        n * 4 * (config.vocab_size * config.hidden_size
                 if VOCAB_KINDS[k][1] == "modules_to_save"
                 else rank * (config.vocab_size + config.hidden_size))
        for k, n in vocab_adapters.items()
    ) + (adapters * tokens * config.hidden_size * 4)
    settings = WorkerSettings(
        model=model,
        served_model_name="base",
        max_loras=(1 + dora + (tokens > 0)) * adapters + sum(vocab_adapters.values()),
        max_lora_rank=rank,
        max_batch_size=prompts,
        max_num_tokens=max(512, prompts * 64),
        kv_cache_bytes=1 << 30,
        lora_vocab_bytes=max(1 << 30, vocab_bytes + (64 << 20)),
    )
    if config.is_moe:  # expert LoRAs: engine_moe.py
        from lorastream.bench.engine_moe import run_moe_engine_bench

        return run_moe_engine_bench(model, checkpoint, adapters, rank, prompts, new_tokens,
                                    repeats, include_peft, peft_new_tokens or new_tokens)
    load_at_start = os.getloadavg()  # a shared machine: what else ran beside the measurement
    shape = checkpoint_shape(model)
    if shape != SMOLLM2_135M:
        log.info("base model shape %s", shape)
    with tempfile.TemporaryDirectory(prefix="lorastream-bench-") as tmp:
        dirs = [
            make_synthetic_adapter(Path(tmp) / f"a{i}", shape, rank=rank, seed=i)
            for i in range(adapters)
        ]
        weights = safe_open(str(checkpoint / "model.safetensors"), "pt") if dora else None
        dora_dirs = [
            make_synthetic_adapter(Path(tmp) / f"d{i}", shape, rank=rank, seed=i, dora=True,
                                   base_weights=None if weights is None else weights.get_tensor)
            for i in range(adapters if dora else 0)
        ]
        token_ids = tuple(range(1, config.vocab_size,
                                max(1, config.vocab_size // max(tokens, 1))))[:tokens]
        token_dirs = [
            make_synthetic_adapter(Path(tmp) / f"t{i}", shape, rank=rank, seed=i,
                                   token_ids=token_ids)
            for i in range(adapters if tokens else 0)
        ]
        vocab_dirs = {
            kind: [make_synthetic_adapter(Path(tmp) / f"{kind}{i}", shape, rank=rank, seed=i,
                                          vocab=(kind,), vocab_size=config.vocab_size)
                   for i in range(n)]
            for kind, n in vocab_adapters.items()
        }
        engine = build_engine(settings, checkpoint=checkpoint)
        # Through the chat template; a base model without one (gemma3-270m) gets the plain text.
        chat = getattr(engine.tokenizer, "chat_template", None) is not None
        questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(prompts)]
        ids = [
            tuple(engine.tokenize(
                PromptInput(messages=(("user", q),)) if chat else PromptInput(text=q)
            ))
            for q in questions
        ]

        def measure() -> dict[str, float]:
            ops = WorkerOperations(engine)
            for i, path in enumerate(dirs):
                ops.load_adapter(f"a{i}", str(path))
            for i, path in enumerate(dora_dirs):
                ops.load_adapter(f"d{i}", str(path))
            for i, path in enumerate(token_dirs):
                ops.load_adapter(f"t{i}", str(path))
            for kind, paths in vocab_dirs.items():
                for i, path in enumerate(paths):
                    ops.load_adapter(f"{kind}{i}", str(path))

            def engine_run(models: list[str]) -> Callable[[int], None]:
                def run(n: int) -> None:
                    params = SamplingParams(max_tokens=n, ignore_eos=True)
                    streams = [
                        engine.submit(m, PromptInput(token_ids=p), params)
                        for m, p in zip(models, ids, strict=True)
                    ]
                    for stream in streams:
                        for _ in stream:
                            pass

                return run

            sides = {"multi": [f"a{i % adapters}" for i in range(prompts)],
                     "base": ["base"] * prompts}
            if dora:
                sides["dora"] = [f"d{i % adapters}" for i in range(prompts)]
            if tokens:
                sides["tokens"] = [f"t{i % adapters}" for i in range(prompts)]
            if mix:
                sides["mix"] = [f"mix:a{i % adapters}=0.5,a{(i + 1) % adapters}=0.5"
                                for i in range(prompts)]
            for kind, n in vocab_adapters.items():
                sides[kind] = [f"{kind}{i % n}" for i in range(prompts)]
            if saved_reference:  # the plain LoRAs over as few distinct adapters
                sides["saved_reference"] = [f"a{i % saved_adapters}" for i in range(prompts)]
            rates = decode_rates([engine_run(m) for m in sides.values()], prompts, new_tokens,
                                 repeats)
            return dict(zip(sides, rates, strict=True))

        # The loop on this thread, as in the worker process (see Engine.run_while).
        rate = engine.run_while(measure)
        multi, base = rate["multi"], rate["base"]
        # Every decode step reads the weights of each distinct adapter in the batch once; how
        # fast this machine reads them, on this thread (its torch threads), after the runs.
        distinct = min(adapters, prompts)
        reads = read_ms(step_read_views(engine.slots, distinct))
        from lorastream.bench.peft_peer import load_mixed_peft

        peft = (
            peft_decode_rate(load_mixed_peft(checkpoint, dirs), [list(p) for p in ids],
                             new_tokens, repeats)
            if include_peft
            else None
        )
    load_at_end = os.getloadavg()
    machine = machine_info()  # after the runs: its bandwidth probe must not disturb them
    step_bytes = distinct * adapter_nbytes(shape, rank, shape.modules)
    result: dict[str, object] = {
        "benchmark": "engine",
        "command": command_line(),
        "model": model,
        "adapters": adapters,
        "rank": rank,
        "targets": "all-linear",
        "prompts": prompts,
        "new_tokens": new_tokens,
        "threads": torch.get_num_threads(),
        "engine_multi_adapter_decode_tok_s": round(multi, 1),
        "engine_base_only_decode_tok_s": round(base, 1),
        "multi_vs_base": round(multi / base, 3),
        "goal_multi_vs_base": ">= 0.85",
        "distinct_adapters_per_step": distinct,
        "adapter_bytes_per_step_mb": round(step_bytes / 1e6, 1),
        "memory_bandwidth_gbs": machine.get("memory_bandwidth_gbs"),
        "slot_read_ms": {"median": round(statistics.median(reads), 2), "best": min(reads),
                         "samples": sorted(reads)},
        "load_average_at_start": [round(v, 2) for v in load_at_start],
        "load_average_at_end": [round(v, 2) for v in load_at_end],
    }
    goals = {"dora": ">= 0.9", "tokens": ">= 0.95", "mix": ">= 0.8"}
    for side in ("dora", "tokens", "mix", *vocab):
        if side not in rate:
            continue
        key = side.replace("-", "_")
        plain = rate.get("saved_reference", multi) if side in saved_kinds else multi
        result |= {f"engine_{key}_decode_tok_s": round(rate[side], 1),
                   f"{key}_vs_lora": round(rate[side] / plain, 3)}
        if side in goals:
            result[f"goal_{key}_vs_lora"] = goals[side]
    if tokens:
        result["new_token_rows"] = tokens
    if saved_reference:
        result |= {"saved_reference_adapters": saved_adapters,
                   "engine_saved_reference_decode_tok_s": round(rate["saved_reference"], 1)}
    if vocab:
        result["vocab_kinds"] = {
            k.replace("-", "_"): {"adapters": n, "module": VOCAB_KINDS[k][0],
                                  "as": VOCAB_KINDS[k][1]}
            for k, n in vocab_adapters.items()
        }
    if peft is not None:
        result |= {
            "peft_mixed_batch_decode_tok_s": round(peft, 1),
            "multi_vs_peft": round(multi / peft, 2),
            "goal_multi_vs_peft": ">= 2.5",
        }
    result["machine"] = machine
    return result

