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
"""

from __future__ import annotations

import json
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
) -> dict[str, object]:
    """``quantization``: "none", or quantized modes (comma-separated) to compare with the fp32 base
    instead (engine_quant.py); ``peft_new_tokens``: the PEFT side's tokens per prompt on a MoE
    base (0: ``new_tokens``)."""
    if mix and adapters < 2:
        raise ValueError("--mix mixes two distinct adapters: use --adapters 2 or more")
    modes = [q for q in quantization.split(",") if q and q != "none"]
    if modes:
        from lorastream.bench.engine_quant import run_quant_bench

        return run_quant_bench(model, modes, adapters, rank, prompts, new_tokens, repeats,
                               include_peft)
    from lorastream.worker.model.checkpoint import resolve_checkpoint
    from lorastream.worker.service.bootstrap import build_engine
    from lorastream.worker.service.config import WorkerSettings
    from lorastream.worker.service.operations import WorkerOperations

    settings = WorkerSettings(
        model=model,
        served_model_name="base",
        max_loras=(1 + dora + (tokens > 0)) * adapters,
        max_lora_rank=rank,
        max_batch_size=prompts,
        max_num_tokens=max(512, prompts * 64),
        kv_cache_bytes=1 << 30,
    )
    checkpoint = resolve_checkpoint(model, cache_dir=settings.model_cache_dir)
    from lorastream.worker.model.config import ModelConfig

    if ModelConfig.from_dir(checkpoint).is_moe:  # expert LoRAs: engine_moe.py
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
        vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
        token_ids = tuple(range(1, vocab, max(1, vocab // max(tokens, 1))))[:tokens]
        token_dirs = [
            make_synthetic_adapter(Path(tmp) / f"t{i}", shape, rank=rank, seed=i,
                                   token_ids=token_ids)
            for i in range(adapters if tokens else 0)
        ]
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

        def measure() -> list[float]:
            ops = WorkerOperations(engine)
            for i, path in enumerate(dirs):
                ops.load_adapter(f"a{i}", str(path))
            for i, path in enumerate(dora_dirs):
                ops.load_adapter(f"d{i}", str(path))
            for i, path in enumerate(token_dirs):
                ops.load_adapter(f"t{i}", str(path))

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

            multi_models = [f"a{i % adapters}" for i in range(prompts)]
            runs = [engine_run(multi_models), engine_run(["base"] * prompts)]
            if dora:
                runs.append(engine_run([f"d{i % adapters}" for i in range(prompts)]))
            if tokens:
                runs.append(engine_run([f"t{i % adapters}" for i in range(prompts)]))
            if mix:
                runs.append(engine_run([
                    f"mix:a{i % adapters}=0.5,a{(i + 1) % adapters}=0.5" for i in range(prompts)
                ]))
            return decode_rates(runs, prompts, new_tokens, repeats)

        # The loop on this thread, as in the worker process (see Engine.run_while).
        multi, base, *more = engine.run_while(measure)
        mix_rate = more[-1:] if mix else []
        more = more[:-1] if mix else more
        dora_rate, tokens_rate = more[:1] if dora else [], more[1:] if dora else more
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
    if dora_rate:
        result |= {
            "engine_dora_decode_tok_s": round(dora_rate[0], 1),
            "dora_vs_lora": round(dora_rate[0] / multi, 3),
            "goal_dora_vs_lora": ">= 0.9",
        }
    if tokens_rate:
        result |= {
            "new_token_rows": tokens,
            "engine_tokens_decode_tok_s": round(tokens_rate[0], 1),
            "tokens_vs_lora": round(tokens_rate[0] / multi, 3),
            "goal_tokens_vs_lora": ">= 0.95",
        }
    if mix_rate:
        result |= {
            "engine_mix_decode_tok_s": round(mix_rate[0], 1),
            "mix_vs_lora": round(mix_rate[0] / multi, 3),
            "goal_mix_vs_lora": ">= 0.8",
        }
    if peft is not None:
        result |= {
            "peft_mixed_batch_decode_tok_s": round(peft, 1),
            "multi_vs_peft": round(multi / peft, 2),
            "goal_multi_vs_peft": ">= 2.5",
        }
    result["machine"] = machine
    return result

