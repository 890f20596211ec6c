"""Prefix caching on chat traffic: the same conversations with the cache on and off, in one run.

Workload (``chat``): ``adapters`` synthetic adapters, each with its own system prompt of
``system_tokens`` token ids; ``clients`` clients at once, client ``i`` talking to adapter
``i % adapters`` in a conversation of ``turns`` turns. Turn ``t``'s prompt is the system prompt,
then every earlier user message and reply, then a new user message of ``user_tokens`` ids::

    turn 1: [system][user 1]
    turn 2: [system][user 1][reply 1][user 2]        reply 1 as generated (greedy)
    ...

Each reply is ``reply_tokens`` tokens (greedy, EOS ignored), so both runs do the same decode work
and must give the same tokens. With the cache, a system prompt is prefilled once per adapter and
each turn prefills only what the last one did not compute.

Workload (``no-sharing``): the same number of requests and clients, each prompt of the chat's
first-turn length but of fresh random ids: the cache never hits, so the run shows what looking
up, registering and evicting blocks costs. It runs as ``turns`` pairs, each pair every client's
one request on both engines (the same prompts), in the order on-off, off-on, on-off, ... so
that drift of a shared machine and warm-up fall on both sides alike; the ratio is the median of
the pairs' ratios. The cache-on engine's cache is left full of the chat's blocks, so its
requests evict cached blocks, as a busy server's would.

Both engines are built once and run at the same time, each on its own loop thread as the worker
process runs it (only one has work at a time).

Then, unless ``routing`` is off (``--no-routing``), the chat workload goes through the gateway
over two workers, its prefix affinity on and off (``lorastream.bench.prefix_routing``).

Figures: time to first token (submit to first event) over all requests, p50; generated
tokens per second of wall time over the whole workload; ratios on / off. Token ids, not text: the
K/V work is the same and no tokenizer round trip blurs the prefixes.
"""

from __future__ import annotations

import gc
import logging
import os
import random
import statistics
import tempfile
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lorastream.bench.machine import command_line, machine_info
from lorastream.bench.prefix_routing import run_routing
from lorastream.bench.prefix_setup import (
    PrefixConfig,
    build,
    quantile,
    random_ids,
    ratio,
    run_clients,
    timed_request,
    worker_settings,
)
from lorastream.bench.synthetic import checkpoint_shape, make_synthetic_adapter

if TYPE_CHECKING:
    from lorastream.worker.engine.engine import Engine

log = logging.getLogger(__name__)

@dataclass
class RunFigures:
    ttft_ms: list[float]
    generated: int
    wall_s: float
    outputs: dict[str, list[int]]
    hit_rate: float

    def summary(self) -> dict[str, object]:
        return {
            "requests": len(self.ttft_ms),
            "ttft_p50_ms": round(statistics.median(self.ttft_ms), 1),
            "ttft_p90_ms": round(quantile(self.ttft_ms, 0.9), 1),
            "generated_tokens": self.generated,
            "wall_s": round(self.wall_s, 2),
            "tokens_per_s": round(self.generated / self.wall_s, 1),
            "prefix_hit_rate": round(self.hit_rate, 3),
        }


def chat_workload(engine: Engine, c: PrefixConfig, vocab: int) -> RunFigures:
    systems = [random_ids(random.Random(f"system-{c.seed}-{a}"), c.system_tokens, vocab)
               for a in range(c.adapters)]
    ttft: list[float] = []
    outputs: dict[str, list[int]] = {}
    lock = threading.Lock()

    def client(i: int) -> None:
        rng = random.Random(f"user-{c.seed}-{i}")
        prompt = list(systems[i % c.adapters])
        for turn in range(c.turns):
            prompt += random_ids(rng, c.user_tokens, vocab)
            ms, reply = timed_request(engine, f"a{i % c.adapters}", prompt, c.reply_tokens)
            prompt += reply
            with lock:
                ttft.append(ms)
                outputs[f"{i}/{turn}"] = reply

    return _measured(engine, c, client, ttft, outputs)


def _measured(engine: Engine, c: PrefixConfig, client: Callable[[int], None],
              ttft: list[float], outputs: dict[str, list[int]]) -> RunFigures:
    """Run ``c.clients`` clients at once and gather what they recorded, with the cache's hit
    rate over the run."""
    before = engine.prefix.stats.hit_tokens, engine.prefix.stats.queried_tokens
    wall = run_clients(c.clients, client)
    hits = engine.prefix.stats.hit_tokens - before[0]
    queried = engine.prefix.stats.queried_tokens - before[1]
    return RunFigures(ttft, sum(len(o) for o in outputs.values()), wall, outputs,
                      hits / queried if queried else 0.0)


def no_sharing_workload(engine: Engine, c: PrefixConfig, vocab: int, pair: int) -> RunFigures:
    """Pair ``pair`` of the no-sharing workload: one request per client, fresh random ids."""
    ttft: list[float] = []
    outputs: dict[str, list[int]] = {}
    lock = threading.Lock()
    length = c.system_tokens + c.user_tokens

    def client(i: int) -> None:
        rng = random.Random(f"random-{c.seed}-{pair}-{i}")
        prompt = random_ids(rng, length, vocab)
        ms, reply = timed_request(engine, f"a{i % c.adapters}", prompt, c.reply_tokens)
        with lock:
            ttft.append(ms)
            outputs[f"{i}/{pair}"] = reply

    return _measured(engine, c, client, ttft, outputs)


def _merged(runs: list[RunFigures]) -> RunFigures:
    """The runs of one side as one run (requests, tokens and wall time summed)."""
    queried = [r for r in runs if r.ttft_ms]
    outputs = {k: v for r in runs for k, v in r.outputs.items()}
    return RunFigures([ms for r in runs for ms in r.ttft_ms], sum(r.generated for r in runs),
                      sum(r.wall_s for r in runs), outputs,
                      statistics.fmean(r.hit_rate for r in queried) if queried else 0.0)


def no_sharing_pairs(on: Engine, off: Engine, c: PrefixConfig, vocab: int
                     ) -> tuple[RunFigures, RunFigures, list[dict[str, object]]]:
    """``c.turns`` pairs in alternating order (on-off, off-on, ...): each side's runs merged, and
    every pair's figures."""
    sides: dict[bool, list[RunFigures]] = {True: [], False: []}
    pairs: list[dict[str, object]] = []
    for pair in range(max(c.turns, 1)):
        order = (True, False) if pair % 2 == 0 else (False, True)
        got = {caching: no_sharing_workload(on if caching else off, c, vocab, pair)
               for caching in order}
        for caching, run in got.items():
            sides[caching].append(run)
        on_s, off_s = got[True].summary(), got[False].summary()
        pairs.append({"first": "on" if order[0] else "off",
                      "on_tokens_per_s": on_s["tokens_per_s"],
                      "off_tokens_per_s": off_s["tokens_per_s"],
                      "on_over_off": ratio(on_s["tokens_per_s"], off_s["tokens_per_s"])})
    return _merged(sides[True]), _merged(sides[False]), pairs


def run_prefix_bench(c: PrefixConfig) -> dict[str, object]:
    from lorastream.worker.model.checkpoint import resolve_checkpoint
    from lorastream.worker.service.config import WorkerSettings

    load_before = os.getloadavg()[0]
    checkpoint = resolve_checkpoint(c.model, cache_dir=WorkerSettings().model_cache_dir)
    shape = checkpoint_shape(c.model)
    with tempfile.TemporaryDirectory(prefix="lorastream-prefix-") as tmp:
        dirs = [make_synthetic_adapter(Path(tmp) / f"a{i}", shape, rank=c.rank, seed=c.seed + i)
                for i in range(c.adapters)]
        engines: list[Engine] = []
        try:
            engines.append(build(c, checkpoint, dirs, worker_settings(c, True)))
            engines.append(build(c, checkpoint, dirs, worker_settings(c, False)))
            on_engine, off_engine = engines
            vocab = on_engine.model.config.vocab_size
            on_chat = chat_workload(on_engine, c, vocab)
            off_chat = chat_workload(off_engine, c, vocab)
            on_random, off_random, pairs = no_sharing_pairs(on_engine, off_engine, c, vocab)
        finally:
            for engine in engines:
                engine.stop()
            engines.clear()
            gc.collect()
        routing = run_routing(c, checkpoint, dirs) if c.routing else None
    on, off = on_chat.summary(), off_chat.summary()
    on_r, off_r = on_random.summary(), off_random.summary()
    same = on_chat.outputs == off_chat.outputs and on_random.outputs == off_random.outputs
    ratios = [p["on_over_off"] for p in pairs if isinstance(p["on_over_off"], float)]
    return {
        "benchmark": "prefix",
        "command": command_line(),
        "machine": machine_info(),
        "load_average_1m_at_start": round(load_before, 2),
        "config": asdict(c),
        "chat": {"on": on, "off": off},
        "no_sharing": {"on": on_r, "off": off_r, "pairs": pairs},
        "ttft_p50_on_over_off": ratio(on["ttft_p50_ms"], off["ttft_p50_ms"]),
        "tokens_per_s_on_over_off": ratio(on["tokens_per_s"], off["tokens_per_s"]),
        # the median of the pairs' ratios: each pair ran back to back, in alternating order
        "no_sharing_tokens_per_s_on_over_off": (round(statistics.median(ratios), 3)
                                                if ratios else None),
        "outputs_identical": 1 if same else 0,
        "routing": routing,
        "goal_ttft": "ttft_p50_on_over_off <= 0.3",
        "goal_throughput": "tokens_per_s_on_over_off >= 1.3",
        "goal_no_sharing": "no_sharing_tokens_per_s_on_over_off >= 0.97",
        "goal_identical": "outputs_identical == 1",
    }
