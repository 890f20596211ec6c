"""Serving benchmark: a store and a worker started here, driven with Poisson arrivals over cold
adapters, run with overlapped loading on and then off, on the same request trace.

Two parts per mode (the worker is restarted between modes, so every adapter starts cold):

1. **trace**: requests arrive as a Poisson process at ``rate`` per second; each names an
   adapter drawn by ``popularity`` (``distinct``, ``uniform`` or ``zipf:ALPHA``) among more
   adapters than the worker has slots. Reported: TTFT, ITL and end-to-end latency
   (p50/p90/p99) and throughput.
2. **interference**: ``background`` long base-model streams decode; their inter-token latency is
   measured first with no loads, then while adapters are loaded one after another (LoadAdapter
   calls, so the batch itself does not change). Reported: the ITL p99 of running streams during
   loads over their ITL p99 without loads.

The worker's peak resident memory is sampled and reported against its configured budgets.

The store process runs at ``nice 10``: in a deployment it is another machine, and on a 2-core
benchmark box it would otherwise take the cores the worker decodes on. The trace rate defaults
to about half of what the default model sustains here, so TTFT measures loading, not queueing.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from lorastream.bench.synthetic import ALL_LINEAR, checkpoint_shape, make_synthetic_adapter
from lorastream.generation import PromptInput, SamplingParams
from lorastream.stack import wait_serving
from lorastream.store_client import StoreClient
from lorastream.worker_client import WorkerClient

QUESTIONS = (
    "What is the capital of France?", "Why is the sky blue?", "Name three fruits.",
    "How do bees make honey?", "What is 12 times 12?", "Describe a cat in one sentence.",
)


@dataclass(frozen=True)
class ServeConfig:
    model: str = "default"
    adapters: int = 24
    slots: int = 8
    rank: int = 64
    rate: float = 0.5  # requests per second
    requests: int = 32
    popularity: str = "zipf:1.2"
    max_tokens: int = 32
    background: int = 4
    background_tokens: int = 2000
    load_phase_s: float = 6.0
    host_cache_bytes: int = 1 << 30
    kv_cache_bytes: int = 512 << 20
    seed: int = 0


@dataclass
class RequestResult:
    arrival: float
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    end: float | None = None
    error: str | None = None


def make_trace(config: ServeConfig) -> list[tuple[float, int, int]]:
    """(arrival offset seconds, adapter index, question index), reproducible from the seed."""
    rng = random.Random(config.seed)
    n = config.adapters
    if config.popularity == "distinct":
        pick = lambda i: i % n  # noqa: E731
    elif config.popularity == "uniform":
        pick = lambda i: rng.randrange(n)  # noqa: E731
    elif config.popularity.startswith("zipf:"):
        alpha = float(config.popularity.split(":", 1)[1])
        weights = [1.0 / (k + 1) ** alpha for k in range(n)]
        order = list(range(n))
        rng.shuffle(order)  # which adapter is popular is arbitrary
        pick = lambda i: order[rng.choices(range(n), weights)[0]]  # noqa: E731
    else:
        raise ValueError(f"popularity {config.popularity!r}: use distinct, uniform or zipf:ALPHA")
    t, trace = 0.0, []
    for i in range(config.requests):
        t += rng.expovariate(config.rate)
        trace.append((t, pick(i), rng.randrange(len(QUESTIONS))))
    return trace


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def q(p: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(p * len(ordered)))] * 1000, 1)

    return {"p50": q(0.50), "p90": q(0.90), "p99": q(0.99)}


def _stream(worker: str, model: str, prompt: PromptInput, params: SamplingParams,
            result: RequestResult, stop: threading.Event | None = None) -> None:
    try:
        with WorkerClient(worker) as client:
            for event in client.generate(model, prompt, params, timeout=600):
                if stop is not None and stop.is_set():
                    break  # closing the stream cancels the request on the worker
                now = time.perf_counter()
                for _ in event.token_ids:
                    result.token_times.append(now)
                if result.first_token is None and event.token_ids:
                    result.first_token = now
    except Exception as err:  # noqa: BLE001 - recorded, reported as an error count
        result.error = f"{type(err).__name__}: {err}"
    result.end = time.perf_counter()


def _itls(results: list[RequestResult], window: tuple[float, float] | None = None) -> list[float]:
    """Inter-token gaps, or those that end inside ``window`` (a stall shows in the gap it ends)."""
    gaps = []
    for r in results:
        for a, b in zip(r.token_times, r.token_times[1:]):
            if window is None or window[0] < b <= window[1]:
                gaps.append(b - a)
    return gaps


class _RssSampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.process = psutil.Process(pid)
        self.peak = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.05):
            try:
                self.peak = max(self.peak, self.process.memory_info().rss)
            except psutil.Error:
                return


def _run_trace(worker: str, config: ServeConfig, prompts: list[PromptInput]) -> dict[str, object]:
    trace = make_trace(config)
    params = SamplingParams(max_tokens=config.max_tokens, ignore_eos=True)
    results, threads = [], []
    start = time.perf_counter()
    for offset, adapter, question in trace:
        delay = start + offset - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        result = RequestResult(arrival=time.perf_counter())
        thread = threading.Thread(
            target=_stream, args=(worker, f"a{adapter}", prompts[question], params, result)
        )
        thread.start()
        results.append(result)
        threads.append(thread)
    for thread in threads:
        thread.join()
    done = [r for r in results if r.error is None and r.first_token is not None]
    elapsed = max(r.end or 0 for r in results) - start
    tokens = sum(len(r.token_times) for r in done)
    return {
        "requests": len(results),
        "errors": len(results) - len(done),
        "ttft_ms": _percentiles([r.first_token - r.arrival for r in done]),  # type: ignore[operator]
        "itl_ms": _percentiles(_itls(done)),
        "e2e_ms": _percentiles([r.end - r.arrival for r in done]),  # type: ignore[operator]
        "throughput_tok_s": round(tokens / elapsed, 1),
        "throughput_req_s": round(len(done) / elapsed, 2),
    }


def _run_interference(worker: str, config: ServeConfig, prompt: PromptInput) -> dict[str, object]:
    params = SamplingParams(max_tokens=config.background_tokens, ignore_eos=True)
    results = [RequestResult(arrival=time.perf_counter()) for _ in range(config.background)]
    stop = threading.Event()
    threads = [threading.Thread(target=_stream, args=(worker, "base", prompt, params, r, stop))
               for r in results]
    for t in threads:
        t.start()
    while any(len(r.token_times) < 3 for r in results):  # all decoding
        time.sleep(0.01)
    quiet_start = time.perf_counter()
    time.sleep(config.load_phase_s / 2)
    quiet = (quiet_start, time.perf_counter())
    load_start = time.perf_counter()
    loads = 0
    with WorkerClient(worker) as client:
        # Cycle through the adapters for at least `load_phase_s`: with more adapters than slots
        # (and than the host budget holds) every load evicts one, and later ones re-fetch.
        while time.perf_counter() - load_start < config.load_phase_s or loads < config.adapters:
            if any(r.end is not None for r in results):
                break
            client.load_adapter(f"a{loads % config.adapters}")
            loads += 1
    loading = (load_start, time.perf_counter())
    stop.set()  # the background streams end here (their calls are cancelled)
    for t in threads:
        t.join()
    quiet_p99 = _percentiles(_itls(results, quiet))["p99"]
    loading_p99 = _percentiles(_itls(results, loading))["p99"]
    return {
        "background_streams": config.background,
        "loads": loads,
        "load_seconds": round(loading[1] - loading[0], 2),
        "itl_p99_ms_no_loads": quiet_p99,
        "itl_p99_ms_during_loads": loading_p99,
        "itl_p99_ratio": round(loading_p99 / quiet_p99, 3) if quiet_p99 and loading_p99 else None,
    }


def _spawn(args: list[str], nice: int = 0) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "lorastream.cli.main", *args, "--log-level", "WARNING"],
        preexec_fn=(lambda: os.nice(nice)) if nice else None,
    )


def run_serve_bench(config: ServeConfig, store_port: int = 50151, worker_port: int = 50152) -> dict:
    with tempfile.TemporaryDirectory(prefix="lorastream-serve-") as tmp:
        root = Path(tmp)
        store = _spawn(
            ["store", "serve", "--port", str(store_port), "--cache-dir", str(root / "store")],
            nice=10,
        )
        target = f"127.0.0.1:{store_port}"
        try:
            wait_serving(target, store, 60)
            shape = checkpoint_shape(config.model)
            with StoreClient(target) as client:
                for i in range(config.adapters):
                    path = make_synthetic_adapter(root / f"a{i}", shape, rank=config.rank,
                                                  targets=ALL_LINEAR, seed=i)
                    for _ in client.preload(str(path), f"a{i}"):
                        pass
                    (path / "adapter_model.safetensors").unlink()  # staged: free the disk
            modes = {}
            for overlap in ("on", "off"):
                modes[f"overlap_{overlap}"] = _run_mode(config, overlap, target, worker_port)
        finally:
            store.terminate()
            store.wait(30)
    on, off = modes["overlap_on"], modes["overlap_off"]
    ttft_on, ttft_off = on["trace"]["ttft_ms"]["p50"], off["trace"]["ttft_ms"]["p50"]
    return {
        "benchmark": "serve",
        "config": config.__dict__,
        **modes,
        "ttft_p50_on_vs_off": round(ttft_on / ttft_off, 3) if ttft_on and ttft_off else None,
        "goal_ttft_p50_on_vs_off": "<= 0.5",
        "itl_p99_during_loads_vs_none_overlap_on": on["interference"]["itl_p99_ratio"],
        "goal_itl_p99_ratio": "<= 1.2",
    }


def _run_mode(config: ServeConfig, overlap: str, store: str, port: int) -> dict[str, object]:
    worker = _spawn([
        "worker", "serve", "--model", config.model, "--served-model-name", "base",
        "--port", str(port), "--store", store, "--max-loras", str(config.slots),
        "--max-lora-rank", str(config.rank), "--lora-overlap-loading", overlap,
        "--host-cache-bytes", str(config.host_cache_bytes),
        "--kv-cache-bytes", str(config.kv_cache_bytes),
    ])
    target = f"127.0.0.1:{port}"
    try:
        wait_serving(target, worker, 600)
        sampler = _RssSampler(worker.pid)
        sampler.start()
        with WorkerClient(target) as client:
            prompts = [PromptInput(messages=(("user", q),)) for q in QUESTIONS]
            for _ in client.generate("base", prompts[0], SamplingParams(max_tokens=4)):
                pass  # warm-up
            trace = _run_trace(target, config, prompts)
            interference = _run_interference(target, config, prompts[0])
            stats = client.stats()
        sampler.stop.set()
        return {
            "trace": trace,
            "interference": interference,
            "worker_peak_rss_mb": round(sampler.peak / 1e6),
            "worker_budgets_mb": {
                "host_adapters": round(stats.host_bytes_budget / 1e6),
                "kv_cache": round(config.kv_cache_bytes / 1e6),
            },
        }
    finally:
        worker.terminate()
        worker.wait(60)
