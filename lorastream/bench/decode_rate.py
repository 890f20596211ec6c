"""How the engine benchmarks measure decode tokens/s, shared by ``engine.py`` (fp32, many
adapters against the base model) and ``engine_quant.py`` (quantized modes against fp32).

Decode tokens/s is measured the same way for every side, so prefill cost cancels out: every
prompt generates exactly ``new_tokens`` tokens (EOS ignored), the whole batch is timed once for
1 token and once for ``new_tokens`` tokens, and

    decode tok/s = prompts * (new_tokens - 1) / (t(new_tokens) - t(1))
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lorastream.bench.peft_peer import MixedPeft

QUESTIONS = (
    "What is the capital of France?",
    "Explain photosynthesis in one sentence.",
    "Give me three tips for writing clean Python code.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23?",
    "Name a famous painting by Vincent van Gogh.",
    "How do vaccines work?",
)


def decode_rates(
    runs: list[Callable[[int], None]], prompts: int, new_tokens: int, repeats: int
) -> list[float]:
    """Best decode tok/s of each run (:func:`decode_rate_samples`)."""
    return [max(samples) for samples in decode_rate_samples(runs, prompts, new_tokens, repeats)]


def decode_rate_samples(
    runs: list[Callable[[int], None]], prompts: int, new_tokens: int, repeats: int
) -> list[list[float]]:
    """Each run's decode tok/s in every repeat ([run][repeat]); the runs take turns within every
    repeat, so that a slow spell of a shared machine hits all of them rather than skewing their
    ratio, and two runs' rates in one repeat are seconds apart (paired)."""
    for run in runs:
        run(2)  # warm-up
    samples: list[list[float]] = [[] for _ in runs]
    for _ in range(repeats):
        for i, run in enumerate(runs):
            start = time.perf_counter()
            run(1)
            one = time.perf_counter() - start
            start = time.perf_counter()
            run(new_tokens)
            full = time.perf_counter() - start
            # a tiny model's prefill varies more than its decode takes: full - one can come out
            # at or below zero, and then the whole run's rate (a lower bound) stands in for it
            decode_s = full - one
            samples[i].append(prompts * (new_tokens - 1) / decode_s if decode_s > 0
                              else prompts * new_tokens / full)
    return samples


def peft_decode_rate(
    peft: MixedPeft, prompts: list[list[int]], new_tokens: int, repeats: int
) -> float:
    """HF transformers + PEFT, every adapter loaded, one mixed-adapter batch (adapter_names=)."""
    from lorastream.bench.peft_peer import left_padded

    model, pad = peft.model, peft.pad
    input_ids, mask = left_padded(prompts, pad)  # [B, S]
    names = [f"a{i % peft.adapters}" for i in range(len(prompts))]

    def run(n: int) -> None:
        with torch.no_grad():
            model.generate(
                input_ids=input_ids, attention_mask=mask, adapter_names=names,
                max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad,
            )

    return decode_rates([run], len(prompts), new_tokens, repeats)[0]
