"""What both parts of ``lorastream bench prefix`` share: the configuration, the workers'
engines, random prompts, and clients run at once (``prefix.py`` drives engines directly,
``prefix_routing.py`` goes through the gateway)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lorastream.core.generation import PromptInput, SamplingParams

if TYPE_CHECKING:
    from lorastream.worker.engine.engine import Engine
    from lorastream.worker.service.config import WorkerSettings

FIRST_ID = 100  # prompts use ids from here up: clear of the special tokens of every model here


@dataclass(frozen=True)
class PrefixConfig:
    model: str = "default"
    adapters: int = 8
    clients: int = 16
    turns: int = 4
    system_tokens: int = 1000
    user_tokens: int = 24
    reply_tokens: int = 32
    rank: int = 8
    kv_cache_bytes: int = 2 << 30
    seed: int = 0
    routing: bool = True  # also the gateway part (lorastream.bench.prefix_routing)


def random_ids(rng: random.Random, count: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(count)]


def timed_request(engine: Engine, model: str, prompt: list[int], reply_tokens: int
           ) -> tuple[float, list[int]]:
    """(TTFT in ms, the reply's tokens) of one greedy request."""
    params = SamplingParams(max_tokens=reply_tokens, ignore_eos=True)
    start = time.perf_counter()
    first: float | None = None
    tokens: list[int] = []
    for event in engine.submit(model, PromptInput(token_ids=tuple(prompt)), params):
        if first is None:
            first = time.perf_counter()
        tokens.extend(event.token_ids)
    assert first is not None
    return (first - start) * 1000, tokens


def run_clients(count: int, body: Callable[[int], None]) -> float:
    """Run ``body(i)`` for clients 0 .. count-1 at once; the wall time in seconds."""
    failures: list[BaseException] = []

    def run(i: int) -> None:
        try:
            body(i)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(i,), name=f"client-{i}") for i in range(count)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    return time.perf_counter() - start


def worker_settings(c: PrefixConfig, caching: bool, max_seq_len: int | None = None
                    ) -> WorkerSettings:
    """The worker's settings for this workload: room for every adapter and client, and for the
    longest conversation (or ``max_seq_len``)."""
    from lorastream.worker.service.config import WorkerSettings

    longest = c.system_tokens + c.turns * (c.user_tokens + c.reply_tokens) + 16
    return WorkerSettings(
        model=c.model, served_model_name="base", max_loras=c.adapters, max_lora_rank=c.rank,
        max_batch_size=max(c.clients, 1), kv_cache_bytes=c.kv_cache_bytes,
        max_seq_len=max_seq_len or longest, prefix_caching=caching, port=0,
    )


def build(c: PrefixConfig, checkpoint: Path, dirs: list[Path], settings: WorkerSettings
          ) -> Engine:
    """An engine as the worker builds it with ``settings``, the adapters loaded, its loop
    started on its own thread (as in the worker process), warmed up with an untimed request."""
    from lorastream.worker.service.bootstrap import build_engine
    from lorastream.worker.service.operations import WorkerOperations

    engine = build_engine(settings, checkpoint=checkpoint)
    ops = WorkerOperations(engine)
    for i, path in enumerate(dirs):
        ops.load_adapter(f"a{i}", str(path))
    engine.start()
    vocab = engine.model.config.vocab_size
    warm_up = random_ids(random.Random("warm-up"), min(64, settings.max_seq_len - 2), vocab)
    timed_request(engine, "a0", warm_up, 2)  # not timed
    engine.reset_prefix_cache()
    return engine


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ratio(a: object, b: object) -> float | None:
    """``a / b`` to 3 decimals; None unless both are numbers and ``b`` is not 0."""
    if not isinstance(a, int | float) or not isinstance(b, int | float) or not b:
        return None
    return round(a / b, 3)
