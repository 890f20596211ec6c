"""Activated LoRA after a base-model turn: the base model's KV blocks shared, or not.

Workload: ``conversations`` conversations, one after another, each a fresh random prompt of
``conversation_tokens`` ids. Turn 1 asks the base model (a greedy reply of ``reply_tokens``);
turn 2 asks an activated LoRA (PEFT's ``alora_invocation_tokens``) on the whole conversation
with its invocation sequence appended, as an aLoRA is used (a check, a rewrite, a judge of the
answer)::

    turn 1, base model:      [conversation]
    turn 2, activated LoRA:  [conversation][reply 1][invocation]     delta from [invocation] on

Both turns run on two engines, prefix caching on and off, in alternating order (on first, then
off first, ...) so that drift of a shared machine falls on both alike. With the cache, turn 2
takes every full block before the invocation from the base model's turn 1 and prefills only
the rest; without it, the whole prompt. On the cache-on engine, a third request asks a plain
LoRA of the same weights to follow the same base turn: its rows all take the delta, so it can
reuse nothing (what activation buys).

Figures: turn 2's time to first token (submit to first event), median over conversations, per
engine, and the ratio on / off (the median of the conversations' ratios); turn 2's
``cached_tokens``; whether the greedy tokens agree on and off. Token ids, not text.
"""

from __future__ import annotations

import gc
import logging
import os
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lorastream.bench.machine import command_line, machine_info
from lorastream.bench.prefix_setup import random_ids, ratio
from lorastream.bench.synthetic import checkpoint_shape, make_synthetic_adapter
from lorastream.core.generation import PromptInput, SamplingParams

if TYPE_CHECKING:
    from lorastream.worker.engine.engine import Engine
    from lorastream.worker.service.config import WorkerSettings

log = logging.getLogger(__name__)

ALORA, LORA = "alora", "lora"  # the adapters' names on both engines


@dataclass(frozen=True)
class AloraConfig:
    model: str = "default"
    conversations: int = 5
    conversation_tokens: int = 1000
    reply_tokens: int = 16
    invocation_tokens: int = 6  # length of the invocation sequence
    rank: int = 16
    seed: int = 0


@dataclass(frozen=True)
class Turn:
    ttft_ms: float
    cached_tokens: int
    tokens: list[int]


def _request(engine: Engine, model: str, prompt: list[int], reply_tokens: int) -> Turn:
    params = SamplingParams(max_tokens=reply_tokens, ignore_eos=True)
    start = time.perf_counter()
    first: float | None = None
    tokens: list[int] = []
    cached = 0
    for event in engine.submit(model, PromptInput(token_ids=tuple(prompt)), params):
        if first is None:
            first = time.perf_counter()
        tokens.extend(event.token_ids)
        cached = event.cached_tokens
    assert first is not None
    return Turn((first - start) * 1000, cached, tokens)


def _settings(c: AloraConfig, caching: bool) -> WorkerSettings:
    from lorastream.worker.service.config import WorkerSettings

    longest = c.conversation_tokens + c.reply_tokens + c.invocation_tokens + c.reply_tokens + 16
    return WorkerSettings(
        model=c.model, served_model_name="base", max_loras=2, max_lora_rank=c.rank,
        max_batch_size=4, kv_cache_bytes=1 << 30, max_seq_len=longest, prefix_caching=caching,
        port=0,
    )


def _build(checkpoint: Path, settings: WorkerSettings, dirs: dict[str, Path]) -> Engine:
    """An engine as the worker builds it, the adapters loaded, its loop on its own thread,
    warmed up with untimed requests to both adapters and the base."""
    from lorastream.worker.service.bootstrap import build_engine
    from lorastream.worker.service.operations import WorkerOperations

    engine = build_engine(settings, checkpoint=checkpoint)
    ops = WorkerOperations(engine)
    for name, path in dirs.items():
        ops.load_adapter(name, str(path))
    engine.start()
    length = min(64, settings.max_seq_len - 4)
    warm_up = random_ids(random.Random("warm-up"), length, engine.model.config.vocab_size)
    for model in ("base", ALORA, LORA):
        _request(engine, model, warm_up, 2)
    engine.reset_prefix_cache()
    return engine


def _conversation(engines: dict[bool, Engine], c: AloraConfig, invocation: list[int],
                  index: int) -> dict[str, object]:
    """One conversation on both engines (``index`` even: cache on first)."""
    vocab = engines[True].model.config.vocab_size
    conversation = random_ids(random.Random(f"conversation-{c.seed}-{index}"),
                              c.conversation_tokens, vocab)
    order = (True, False) if index % 2 == 0 else (False, True)
    base: dict[bool, Turn] = {}
    activated: dict[bool, Turn] = {}
    for caching in order:
        engine = engines[caching]
        base[caching] = _request(engine, "base", conversation, c.reply_tokens)
        prompt = [*conversation, *base[caching].tokens, *invocation]
        activated[caching] = _request(engine, ALORA, prompt, c.reply_tokens)
    # a plain LoRA after the same base turn (cache on): nothing of the base's is its own
    prompt = [*conversation, *base[True].tokens, *invocation]
    plain = _request(engines[True], LORA, prompt, c.reply_tokens)
    return {
        "first": "on" if order[0] else "off",
        "prompt_tokens": len(prompt),
        "alora_ttft_on_ms": round(activated[True].ttft_ms, 1),
        "alora_ttft_off_ms": round(activated[False].ttft_ms, 1),
        "alora_cached_on": activated[True].cached_tokens,
        "alora_cached_off": activated[False].cached_tokens,
        "base_ttft_on_ms": round(base[True].ttft_ms, 1),
        "base_ttft_off_ms": round(base[False].ttft_ms, 1),
        "lora_ttft_on_ms": round(plain.ttft_ms, 1),
        "lora_cached_on": plain.cached_tokens,
        "on_over_off": ratio(activated[True].ttft_ms, activated[False].ttft_ms),
        "identical": (base[True].tokens == base[False].tokens
                      and activated[True].tokens == activated[False].tokens),
    }


def _median(rows: list[dict[str, object]], key: str) -> float:
    return round(statistics.median(float(r[key]) for r in rows), 1)  # type: ignore[arg-type]  # numbers by construction


def run_alora_bench(c: AloraConfig) -> dict[str, object]:
    from lorastream.worker.model.checkpoint import resolve_checkpoint
    from lorastream.worker.model.config import ModelConfig
    from lorastream.worker.service.config import WorkerSettings

    load_before = os.getloadavg()[0]
    checkpoint = resolve_checkpoint(c.model, cache_dir=WorkerSettings().model_cache_dir)
    shape = checkpoint_shape(c.model)
    vocab = ModelConfig.from_dir(checkpoint).vocab_size
    invocation = random_ids(random.Random(f"invocation-{c.seed}"), c.invocation_tokens, vocab)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lorastream-alora-") as tmp:
        dirs = {
            ALORA: make_synthetic_adapter(Path(tmp) / ALORA, shape, rank=c.rank, seed=c.seed,
                                          alora_invocation_tokens=invocation),
            LORA: make_synthetic_adapter(Path(tmp) / LORA, shape, rank=c.rank, seed=c.seed),
        }
        engines: dict[bool, Engine] = {}
        try:
            for caching in (True, False):
                engines[caching] = _build(checkpoint, _settings(c, caching), dirs)
            rows = [_conversation(engines, c, invocation, i) for i in range(c.conversations)]
        finally:
            for engine in engines.values():
                engine.stop()
            engines.clear()
            gc.collect()
    ratios = [float(r["on_over_off"]) for r in rows if isinstance(r["on_over_off"], float)]
    on, off = _median(rows, "alora_ttft_on_ms"), _median(rows, "alora_ttft_off_ms")
    return {
        "benchmark": "alora",
        "command": command_line(),
        "machine": machine_info(),
        "load_average_1m_at_start": round(load_before, 2),
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        "wall_s": round(time.perf_counter() - started, 1),
        "config": asdict(c),
        "conversations": rows,
        "alora_ttft_p50_on_ms": on,
        "alora_ttft_p50_off_ms": off,
        "lora_ttft_p50_on_ms": _median(rows, "lora_ttft_on_ms"),
        "base_ttft_p50_ms": _median(rows, "base_ttft_off_ms"),
        "alora_cached_tokens_on": statistics.median(int(r["alora_cached_on"]) for r in rows),  # type: ignore[call-overload]  # ints by construction
        # the median of the conversations' ratios: each ran on both engines back to back
        "alora_ttft_on_over_off": round(statistics.median(ratios), 3) if ratios else None,
        "outputs_identical": 1 if all(r["identical"] for r in rows) else 0,
        "goal_ttft": "alora_ttft_on_over_off <= 0.3",
        "goal_identical": "outputs_identical == 1",
    }
