"""Soak benchmark: two workers behind the gateway, overloaded for minutes, one of them restarted
half-way; does anything leak, lie or go wrong?

1. **setup**: a store holding ``adapters`` synthetic adapters (attention projections, rank
   ``rank``, fp16), ``workers`` workers and a gateway over them (``--max-requests-per-worker``).
2. **warm-up**: every adapter asked for once (so each worker's host tier reaches its working
   set), then the **capacity** phase: ``capacity_concurrency`` clients in a closed loop for
   ``capacity_seconds``, zipf adapters; capacity = completed requests/s. The workers' RSS after
   a short idle is the post-warm-up level.
3. **soak**: Poisson arrivals at ``load_factor`` x capacity for ``duration_s``, greedy
   streamed chat completions, ``cancel_fraction`` of them closed by the client mid-stream; at
   half time the last worker is stopped (``restart``: ``kill`` = SIGKILL, ``term`` = SIGTERM,
   its drain) and started again. Every worker's RSS is sampled each second.
4. **settle**: ``settle_s`` idle, then each worker's counters (running, waiting, loading, KV
   tokens, adapter references; slots used for information) and RSS; then ``greedy_sample``
   completed requests are sent again one at a time and their text compared (greedy: equal).

Goals: no 503 while a worker was serving; no wrong output; the surviving workers' settled RSS
within 5% of their post-warm-up level; every counter back to 0.
"""

from __future__ import annotations

import random
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from lorastream.bench.harness import (
    QUESTIONS,
    adapter_picker,
    free_port,
    percentiles,
    running_gateway,
    running_store,
)
from lorastream.bench.machine import command_line, machine_info
from lorastream.bench.scale import ScaleConfig, adapter_name, register_adapters
from lorastream.bench.soak_client import (
    SoakRequest,
    count_outcomes,
    error_kinds,
    send,
)
from lorastream.bench.soak_workers import Workers
from lorastream.bench.synthetic import ATTENTION, checkpoint_shape
from lorastream.core.worker_client import WorkerClient

CDF_POINTS = 200  # quantiles kept per latency CDF
SETTLED_COUNTERS = ("running_requests", "waiting_requests", "loading_adapters", "kv_tokens_used",
                    "adapter_references")


@dataclass(frozen=True)
class SoakConfig:
    model: str = "default"
    workers: int = 2
    adapters: int = 100
    rank: int = 8
    popularity: str = "zipf:1.1"
    slots: int = 16
    max_tokens: int = 32
    capacity_concurrency: int = 16
    capacity_seconds: float = 30.0
    load_factor: float = 2.0  # soak arrival rate over the measured capacity
    duration_s: float = 600.0
    cancel_fraction: float = 0.25
    restart: str = "kill"  # how the last worker is stopped half-way: kill (SIGKILL) or term
    settle_s: float = 10.0
    greedy_sample: int = 60
    max_requests_per_worker: int = 48
    host_cache_bytes: int = 1 << 30
    kv_cache_bytes: int = 256 << 20
    worker_drain_s: float = 5.0
    # each worker on its own share of the CPUs (see soak_workers.Workers.cpus)
    pin_workers: bool = True
    seed: int = 0


def _http_client() -> httpx.Client:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    return httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0), limits=limits)


def _open_loop(requests: list[SoakRequest], offsets: list[float], url: str,
               max_tokens: int) -> None:
    """Send each request ``offsets[i]`` seconds from now, one thread each; wait for all."""
    threads = []
    with _http_client() as client:
        start = time.perf_counter()
        for request, offset in zip(requests, offsets, strict=True):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            thread = threading.Thread(target=send, args=(client, url, request, max_tokens))
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()


def _in_parallel(requests: list[SoakRequest], url: str, max_tokens: int, clients: int) -> None:
    """``clients`` clients taking ``requests`` in order, each sent when one is free."""
    queue = iter(requests)
    lock = threading.Lock()
    with _http_client() as client:
        def loop() -> None:
            while True:
                with lock:
                    request = next(queue, None)
                if request is None:
                    return
                send(client, url, request, max_tokens)

        threads = [threading.Thread(target=loop) for _ in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def _closed_loop(url: str, config: SoakConfig, pick: Callable[[int], int],
                 rng: random.Random) -> dict[str, object]:
    """``capacity_concurrency`` clients back to back for ``capacity_seconds``."""
    c = config
    done: list[SoakRequest] = []
    stop_at = time.perf_counter() + c.capacity_seconds
    lock = threading.Lock()
    with _http_client() as client:
        def loop(k: int) -> None:
            i = 0
            while time.perf_counter() < stop_at:
                with lock:
                    request = SoakRequest(adapter_name(pick(k * 1_000_000 + i)),
                                          rng.choice(QUESTIONS), None)
                send(client, url, request, c.max_tokens)
                with lock:
                    done.append(request)
                i += 1

        start = time.perf_counter()
        pool = [threading.Thread(target=loop, args=(k,)) for k in range(c.capacity_concurrency)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        elapsed = time.perf_counter() - start
    # completions inside the window over its length (the requests open at its end finish
    # later, and are not counted)
    ok = [r for r in done if r.status == 200 and r.done and r.end is not None
          and r.end <= stop_at]
    return {"concurrency": c.capacity_concurrency, "seconds": c.capacity_seconds,
            "requests": len(done), "completed_in_window": len(ok),
            "drained_s": round(elapsed - c.capacity_seconds, 1),
            "req_s": round(len(ok) / c.capacity_seconds, 2)}


def make_soak_requests(config: SoakConfig, rate: float) -> tuple[list[SoakRequest], list[float]]:
    """The soak's requests and their arrival offsets (Poisson at ``rate`` over ``duration_s``);
    a ``cancel_fraction`` of them close after 1..max_tokens/2 content chunks."""
    c = config
    rng = random.Random(c.seed)
    pick = adapter_picker(c.adapters, c.popularity, random.Random(f"{c.seed}/adapters"))
    requests: list[SoakRequest] = []
    offsets: list[float] = []
    t = 0.0
    while (t := t + rng.expovariate(rate)) < c.duration_s:
        cancel = rng.randint(1, max(1, c.max_tokens // 2)) if rng.random() < c.cancel_fraction \
            else None
        requests.append(SoakRequest(adapter_name(pick(len(requests))),
                                    rng.choice(QUESTIONS), cancel))
        offsets.append(t)
    return requests, offsets


def settled_counters(target: str) -> dict[str, float]:
    """A worker's queue, KV and reference counters (all 0 when idle) and its slots in use."""
    with WorkerClient(target) as client:
        stats = client.stats()
        adapters, _ = client.list_adapters()
    return {"running_requests": stats.running_requests,
            "waiting_requests": stats.waiting_requests,
            "loading_adapters": stats.loading_adapters,
            "kv_tokens_used": stats.kv_tokens_used,
            "adapter_references": sum(a.references for a in adapters),
            "device_slots_used": stats.device_slots_used,
            "host_mb_used": round(stats.host_bytes_used / 1e6, 1)}


def cdf_points(values: list[float]) -> list[float]:
    """At most ``CDF_POINTS`` evenly spaced quantiles of ``values`` (seconds), in ms."""
    ordered = sorted(values)
    if len(ordered) > CDF_POINTS:
        last = len(ordered) - 1
        ordered = [ordered[round(k * last / (CDF_POINTS - 1))] for k in range(CDF_POINTS)]
    return [round(v * 1000, 1) for v in ordered]


def latency(requests: list[SoakRequest]) -> dict[str, object]:
    """TTFT of every request that streamed a token; end-to-end of those read to ``[DONE]``."""
    ttfts = [r.first_token - r.arrival for r in requests
             if r.status == 200 and r.first_token is not None]
    e2es = [r.end - r.arrival for r in requests if r.status == 200 and r.done
            and r.end is not None and r.error is None]
    return {"ttft_ms": percentiles(ttfts), "e2e_ms": percentiles(e2es),
            "cdf": {"ttft_ms": cdf_points(ttfts), "e2e_ms": cdf_points(e2es)}}


def rss_growth(post_warm_up: float | None, settled: float | None) -> float | None:
    """``settled / post_warm_up - 1``, rounded to 0.001; None unless both were measured."""
    if not post_warm_up or settled is None:
        return None
    return round(settled / post_warm_up - 1, 3)


def _greedy_check(url: str, requests: list[SoakRequest], config: SoakConfig) -> dict[str, object]:
    """Send ``greedy_sample`` completed soak requests again, one at a time; count the texts
    that differ."""
    done = [r for r in requests if r.status == 200 and r.done and r.error is None]
    sample = random.Random(config.seed).sample(done, min(config.greedy_sample, len(done)))
    wrong = []
    with _http_client() as client:
        for original in sample:
            rerun = SoakRequest(original.adapter, original.question, None)
            send(client, url, rerun, config.max_tokens)
            if rerun.text != original.text or not rerun.done:
                wrong.append({"adapter": original.adapter, "question": original.question,
                              "soak": original.text, "quiet": rerun.text,
                              "quiet_error": rerun.error})
    return {"sampled": len(sample), "wrong": len(wrong), "examples": wrong[:3]}


def run_soak_bench(config: SoakConfig) -> dict[str, object]:
    c = config
    if c.restart not in ("kill", "term"):
        raise ValueError(f"restart {c.restart!r}: use kill or term")
    store_port, gateway_port = free_port(), free_port()
    store = f"127.0.0.1:{store_port}"
    url = f"http://127.0.0.1:{gateway_port}/v1/chat/completions"
    with tempfile.TemporaryDirectory(prefix="lorastream-soak-") as tmp:
        root = Path(tmp)
        with running_store(root / "store", store_port):
            registration = register_adapters(
                store, ScaleConfig(counts=(c.adapters,), ranks=(c.rank,), targets=ATTENTION,
                                   seed=c.seed),
                checkpoint_shape(c.model))
            workers = Workers(c, store)
            try:
                for i in range(c.workers):
                    workers.start(i)
                workers.start_sampling()
                gateway_flags = ("--max-requests-per-worker", str(c.max_requests_per_worker),
                                 "--drain-seconds", "2")
                with running_gateway(gateway_port, store, workers.targets, *gateway_flags):
                    result = _run_phases(c, url, workers)
            finally:
                workers.close()
    return {"benchmark": "soak", "command": command_line(), "machine": machine_info(),
            "config": asdict(c), "registration": registration, **result}


def _run_phases(c: SoakConfig, url: str, workers: Workers) -> dict[str, object]:
    rng = random.Random(c.seed)
    warm = [SoakRequest(adapter_name(i), QUESTIONS[i % len(QUESTIONS)], None)
            for i in range(c.adapters)]
    _in_parallel(warm, url, 4, c.capacity_concurrency)
    pick = adapter_picker(c.adapters, c.popularity, random.Random(f"{c.seed}/capacity"))
    capacity = _closed_loop(url, c, pick, rng)
    time.sleep(3.0)  # idle, as after the settle
    post_warm_up = [workers.resident_mb(i) for i in range(c.workers)]
    warm_up_end = round(time.perf_counter() - workers.t0, 1)

    rate = max(0.1, c.load_factor * float(capacity["req_s"]))  # type: ignore[arg-type]  # capacity: JSON-like dict, req_s a number
    requests, offsets = make_soak_requests(c, rate)
    restarted = c.workers - 1
    restart: dict[str, object] = {}

    def restart_half_way() -> None:
        time.sleep(c.duration_s / 2)
        restart.update(workers.restart(restarted, c.restart))

    soak_start = round(time.perf_counter() - workers.t0, 1)
    restarter = threading.Thread(target=restart_half_way)
    restarter.start()
    _open_loop(requests, offsets, url, c.max_tokens)
    restarter.join()
    soak_end = round(time.perf_counter() - workers.t0, 1)

    time.sleep(c.settle_s)
    counters = [settled_counters(t) for t in workers.targets]
    settled = [workers.resident_mb(i) for i in range(c.workers)]
    greedy = _greedy_check(url, requests, c)
    outcomes = count_outcomes(requests, workers.lifetimes)
    survivors = [i for i in range(c.workers) if i != restarted]
    growths = [rss_growth(post_warm_up[i], settled[i]) for i in survivors]
    measured = [g for g in growths if g is not None]
    nonzero = sum(counter[k] for counter in counters for k in SETTLED_COUNTERS)
    return {
        "capacity": capacity,
        "soak": {"rate_req_s": round(rate, 2), "duration_s": c.duration_s,
                 "requests": len(requests), "cancel_planned": sum(
                     r.cancel_after is not None for r in requests),
                 "outcomes": outcomes, "error_kinds": error_kinds(requests, workers.lifetimes),
                 "restart": restart},
        "latency": latency(requests),
        "rss": {
            "timeline_mb": [[list(p) for p in worker] for worker in workers.rss],
            "marks_s": {"warm_up_end": warm_up_end, "soak_start": soak_start,
                        "restart": restart.get("at_s"), "soak_end": soak_end},
            "post_warm_up_mb": post_warm_up, "settled_mb": settled,
            "restarted_worker": restarted, "growth_surviving": growths,
        },
        "settled": counters,
        "greedy": greedy,
        "unavailable_503_worker_alive": outcomes["unavailable_503_worker_alive"],
        "goal_503_worker_alive": "== 0",
        "wrong_outputs": greedy["wrong"],
        "goal_wrong_outputs": "== 0",
        "rss_growth_max": max(measured) if measured else None,
        "goal_rss_growth": "<= 0.05",
        "settled_counters_nonzero": nonzero,
        "goal_settled_counters": "== 0",
    }
