"""Prefix-aware routing measured live: two workers behind the gateway on loopback, the chat
workload sent through it as OpenAI completions, with the gateway's prefix affinity on and off
(``--prefix-affinity-entries 0``: residency and load alone, the routing before it).

Both workers cache prefixes and hold every adapter on the device (hot adapters spread over a
fleet), so residency does not decide where a turn goes: load does, and prefix affinity. The
conversations are those of ``lorastream.bench.prefix`` in text: each adapter's system prompt and
each user message are the tokenizer's text of random ids, each turn's prompt is the whole
conversation so far (the replies as the gateway returned them), a greedy reply of
``reply_tokens`` tokens (EOS ignored). Clients do not move in lockstep, as users do not: each
starts after a pause of up to ``THINK_S`` and thinks up to twice that between turns (seeded: the
same pauses on both sides), so the workers' queues differ from one turn to the next. Before each
side both workers' caches are emptied and a new gateway starts; the side with affinity runs
first. Wall time includes the pauses.

Figures per side: the share of follow-up turns (2 and later) routed to the worker that served the
conversation's previous turn (from the gateway's routing debug line, ``dispatch.ROUTED``, matched
to the response's ``id``); prompt tokens served from a worker's cache
(``usage.prompt_tokens_details.cached_tokens``) over all prompt tokens, of follow-up turns and of
all turns; requests per worker; TTFT p50/p90 (submit to the first streamed text) and tokens/s.
"""

from __future__ import annotations

import logging
import random
import secrets
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from lorastream.bench.harness import serve_app, sse_chunk
from lorastream.bench.prefix_setup import (
    PrefixConfig,
    build,
    quantile,
    random_ids,
    ratio,
    run_clients,
    worker_settings,
)

if TYPE_CHECKING:
    import grpc
    import uvicorn

    from lorastream.worker.engine.engine import Engine

# the gateway's --prefix-affinity-entries: its default, and off
SIDES: dict[str, int | None] = {"affinity": None, "no_affinity": 0}
THINK_S = 1.0  # a client starts within this, and waits up to twice this between its turns


@dataclass(frozen=True)
class Turn:
    client: int
    turn: int
    request_id: str
    ttft_ms: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    text: str


class RouteLog(logging.Filter):
    """Catches the gateway dispatcher's routing line of every generation (request id -> worker,
    reason) while installed; the line is not printed, every other record is as before."""

    def __init__(self) -> None:
        super().__init__()
        self.routes: dict[str, tuple[str, str]] = {}
        self._logger = logging.getLogger("lorastream.gateway.dispatch")
        self._level = self._shown = logging.NOTSET

    def filter(self, record: logging.LogRecord) -> bool:
        from lorastream.gateway.dispatch import ROUTED

        if record.msg == ROUTED and isinstance(record.args, tuple) and len(record.args) == 4:
            request_id, _model, target, reason = record.args
            self.routes[str(request_id)] = (str(target), str(reason))
            return False
        return record.levelno >= self._shown  # what the logger let through before

    def __enter__(self) -> RouteLog:
        self._level, self._shown = self._logger.level, self._logger.getEffectiveLevel()
        self._logger.addFilter(self)
        self._logger.setLevel(logging.DEBUG)
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.setLevel(self._level)
        self._logger.removeFilter(self)


class RunningGateway:
    """The gateway app served by uvicorn on a loopback port of its own, in a thread."""

    def __init__(self, workers: list[str], token: str, affinity_entries: int | None) -> None:
        from lorastream.gateway.app import create_app
        from lorastream.gateway.config import GatewaySettings

        table = {} if affinity_entries is None else {"prefix_affinity_entries": affinity_entries}
        settings = GatewaySettings(
            workers=workers, token=token, **table,  # type: ignore[arg-type]  # a field by name
            store="127.0.0.1:1",  # no store runs: completions never ask it
        )
        self.server: uvicorn.Server
        self.server, self.thread, self.url = serve_app(create_app(settings), "gateway")
        self._wait_healthy(len(workers))

    def _wait_healthy(self, workers: int) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            health = httpx.get(f"{self.url}/health", timeout=5)
            if health.status_code == 200 and sum(
                    w["healthy"] for w in health.json()["workers"].values()) == workers:
                return
            time.sleep(0.1)
        raise RuntimeError(f"the gateway did not see {workers} healthy workers")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def _complete(client: httpx.Client, model: str, prompt: str, reply_tokens: int,
              ) -> tuple[str, float, dict[str, Any], str]:
    """(response id, TTFT in ms, usage, text) of one greedy streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": reply_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first: float | None = None
    request_id, text = "", []
    usage: dict[str, Any] = {}
    with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"completion for {model}: HTTP {response.status_code}: "
                               f"{response.read().decode(errors='replace')}")
        for line in response.iter_lines():
            chunk = sse_chunk(line)
            if chunk is None:
                continue
            if "error" in chunk:
                raise RuntimeError(f"completion for {model}: {chunk['error']}")
            request_id = request_id or chunk.get("id", "")
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    first = first or time.perf_counter()
                    text.append(choice["text"])
            usage = chunk.get("usage") or usage
    if first is None or not usage:
        raise RuntimeError(f"completion for {model}: no text or no usage in the stream")
    return request_id, (first - start) * 1000, usage, "".join(text)


def chat_through(gateway: RunningGateway, token: str, c: PrefixConfig, decode: Any, vocab: int
                 ) -> tuple[list[Turn], float]:
    """Every client's conversation through the gateway, all at once; (turns, wall seconds)."""
    systems = [decode(random_ids(random.Random(f"system-{c.seed}-{a}"), c.system_tokens, vocab))
               for a in range(c.adapters)]
    turns: list[Turn] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        rng = random.Random(f"user-{c.seed}-{i}")
        think = random.Random(f"think-{c.seed}-{i}")  # the same pauses on both sides
        prompt = systems[i % c.adapters]
        with httpx.Client(base_url=gateway.url, timeout=600,
                          headers={"Authorization": f"Bearer {token}"}) as http:
            for t in range(c.turns):
                time.sleep(think.uniform(0, THINK_S * (2 if t else 1)))
                prompt += "\n" + decode(random_ids(rng, c.user_tokens, vocab))
                rid, ttft, usage, reply = _complete(http, f"a{i % c.adapters}", prompt,
                                                    c.reply_tokens)
                prompt += reply
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                with lock:
                    turns.append(Turn(i, t, rid, ttft, usage["prompt_tokens"], cached,
                                      usage["completion_tokens"], reply))

    return turns, run_clients(c.clients, client)


def side_figures(turns: list[Turn], routes: dict[str, tuple[str, str]], workers: list[str],
                 wall_s: float) -> dict[str, Any]:
    """One side's figures (module docstring); every turn's route must have been logged."""
    missing = [t.request_id for t in turns if t.request_id not in routes]
    if missing:
        raise RuntimeError(f"no routing line for {len(missing)} requests (e.g. {missing[0]}): "
                           "the gateway's dispatch.ROUTED debug line changed?")
    target = {(t.client, t.turn): routes[t.request_id][0] for t in turns}
    follow = [t for t in turns if t.turn > 0]
    same = sum(target[(t.client, t.turn)] == target[(t.client, t.turn - 1)] for t in follow)
    served = Counter(target.values())

    def cached_share(ts: list[Turn]) -> float | None:
        prompt = sum(t.prompt_tokens for t in ts)
        return round(sum(t.cached_tokens for t in ts) / prompt, 3) if prompt else None

    ttft = [t.ttft_ms for t in turns]
    generated = sum(t.completion_tokens for t in turns)
    return {
        "requests": len(turns),
        "follow_ups_on_previous_worker": round(same / len(follow), 3) if follow else None,
        "cached_share_follow_ups": cached_share(follow),
        "cached_share_all": cached_share(turns),
        "requests_per_worker": [served.get(w, 0) for w in workers],
        "reasons": dict(sorted(Counter(reason for _, reason in routes.values()).items())),
        "ttft_p50_ms": round(statistics.median(ttft), 1),
        "ttft_p90_ms": round(quantile(ttft, 0.9), 1),
        "generated_tokens": generated,
        "wall_s": round(wall_s, 2),
        "tokens_per_s": round(generated / wall_s, 1),
    }


def run_routing(c: PrefixConfig, checkpoint: Path, dirs: list[Path]) -> dict[str, Any]:
    """Both sides over the same two workers (module docstring)."""
    from transformers import AutoConfig

    from lorastream.worker.service.server import create_server

    # text prompts: their token count is the tokenizer's, so the model's whole context
    context = AutoConfig.from_pretrained(checkpoint).max_position_embeddings
    settings = worker_settings(c, True, max_seq_len=context)
    engines: list[Engine] = []
    servers: list[grpc.Server] = []
    workers: list[str] = []
    sides: dict[str, dict[str, Any]] = {}
    replies: dict[str, dict[tuple[int, int], str]] = {}
    try:
        for _ in range(2):
            engine = build(c, checkpoint, dirs, settings)
            engines.append(engine)
            server, port, _ = create_server(settings, engine, start_engine=False)
            server.start()
            servers.append(server)
            workers.append(f"127.0.0.1:{port}")
        token = secrets.token_urlsafe(16)  # the gateway's operate token, used as the API key
        decode = engines[0].tokenizer.decode
        vocab = engines[0].model.config.vocab_size
        for side, entries in SIDES.items():
            for engine in engines:
                engine.reset_prefix_cache()
            gateway = RunningGateway(workers, token, entries)
            try:
                with RouteLog() as log:
                    turns, wall = chat_through(gateway, token, c, decode, vocab)
            finally:
                gateway.stop()
            sides[side] = side_figures(turns, log.routes, workers, wall)
            replies[side] = {(t.client, t.turn): t.text for t in turns}
    finally:
        for server in servers:
            server.stop(None).wait()
        for engine in engines:
            engine.stop()
    on, off = sides["affinity"], sides["no_affinity"]
    return {
        "workers": len(workers),
        "think_s": THINK_S,
        **sides,
        "ttft_p50_affinity_over_none": ratio(on["ttft_p50_ms"], off["ttft_p50_ms"]),
        "tokens_per_s_affinity_over_none": ratio(on["tokens_per_s"], off["tokens_per_s"]),
        "outputs_identical": 1 if replies["affinity"] == replies["no_affinity"] else 0,
    }
