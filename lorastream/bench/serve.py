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
benchmark box it would otherwise take the cores the worker decodes on. For the same reason its
egress is capped at ``store_link_mbps`` (default 125 MB/s, a 1 Gb/s link): on loopback the
"network" would otherwise run at memory speed and cost the worker's cores, where a real link
moves the bytes without them. The trace rate defaults
to about half of what the default model sustains here, so TTFT measures loading and the stalls
loads cause, not a saturated queue.
"""

from __future__ import annotations

import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from lorastream.bench.harness import (
    PROMPTS,
    RequestResult,
    RssSampler,
    free_port,
    itls,
    make_trace,
    percentiles,
    replay,
    running,
    running_store,
    samples_ms,
    stream,
    summarise,
    warm_up,
)
from lorastream.bench.machine import command_line, machine_info
from lorastream.bench.synthetic import ALL_LINEAR, checkpoint_shape, make_synthetic_adapter
from lorastream.generation import PromptInput, SamplingParams
from lorastream.store_client import StoreClient
from lorastream.worker_client import WorkerClient


@dataclass(frozen=True)
class ServeConfig:
    model: str = "default"
    adapters: int = 24
    slots: int = 8
    rank: int = 64
    rate: float = 1.0  # requests per second, about half of what the default model sustains
    requests: int = 32
    popularity: str = "zipf:1.2"
    max_tokens: int = 32
    background: int = 4
    background_tokens: int = 2000
    load_phase_s: float = 6.0
    host_cache_bytes: int = 1 << 30
    kv_cache_bytes: int = 512 << 20
    store_link_mbps: float = 125.0  # the store's egress cap: a 1 Gb/s link; 0 = loopback speed
    seed: int = 0


def _run_trace(worker: str, config: ServeConfig) -> dict[str, object]:
    c = config
    trace = make_trace(c.adapters, c.popularity, c.rate, c.requests, c.seed)
    params = SamplingParams(max_tokens=config.max_tokens, ignore_eos=True)
    results, start = replay(worker, trace, params, lambda adapter: f"a{adapter}")
    return summarise(results, start)


def _run_interference(worker: str, config: ServeConfig, prompt: PromptInput) -> dict[str, object]:
    params = SamplingParams(max_tokens=config.background_tokens, ignore_eos=True)
    results = [RequestResult(arrival=time.perf_counter()) for _ in range(config.background)]
    stop = threading.Event()
    threads = [threading.Thread(target=stream, args=(worker, "base", prompt, params, r, stop))
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
    quiet_gaps, loading_gaps = itls(results, quiet), itls(results, loading)
    quiet_p99 = percentiles(quiet_gaps)["p99"]
    loading_p99 = percentiles(loading_gaps)["p99"]
    return {
        "background_streams": config.background,
        "loads": loads,
        "load_seconds": round(loading[1] - loading[0], 2),
        "itl_p99_ms_no_loads": quiet_p99,
        "itl_p99_ms_during_loads": loading_p99,
        "itl_p99_ratio": round(loading_p99 / quiet_p99, 3) if quiet_p99 and loading_p99 else None,
        "samples": {
            "itl_ms_no_loads": samples_ms(quiet_gaps),
            "itl_ms_during_loads": samples_ms(loading_gaps),
        },
    }


def run_serve_bench(config: ServeConfig, store_port: int = 0, worker_port: int = 0) -> dict:
    """Both modes on one store; ports 0 pick free ones."""
    store_port = store_port or free_port()
    worker_port = worker_port or free_port()
    with tempfile.TemporaryDirectory(prefix="lorastream-serve-") as tmp:
        root = Path(tmp)
        with running_store(root / "store", store_port, config.store_link_mbps):
            target = f"127.0.0.1:{store_port}"
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
    on, off = modes["overlap_on"], modes["overlap_off"]
    ttft_on, ttft_off = on["trace"]["ttft_ms"]["p50"], off["trace"]["ttft_ms"]["p50"]
    return {
        "benchmark": "serve",
        "command": command_line(),
        "machine": machine_info(),
        "config": asdict(config),
        **modes,
        "ttft_p50_on_vs_off": round(ttft_on / ttft_off, 3) if ttft_on and ttft_off else None,
        "goal_ttft_p50_on_vs_off": "<= 0.5",
        "itl_p99_during_loads_vs_none_overlap_on": on["interference"]["itl_p99_ratio"],
        "goal_itl_p99_ratio": "<= 1.2",
    }


def _run_mode(config: ServeConfig, overlap: str, store: str, port: int) -> dict:
    args = [
        "worker", "serve", "--model", config.model, "--served-model-name", "base",
        "--port", str(port), "--store", store, "--max-loras", str(config.slots),
        "--max-lora-rank", str(config.rank), "--lora-overlap-loading", overlap,
        "--host-cache-bytes", str(config.host_cache_bytes),
        "--kv-cache-bytes", str(config.kv_cache_bytes),
    ]
    target = f"127.0.0.1:{port}"
    with running(args, port) as worker:
        sampler = RssSampler(worker.pid)
        sampler.start()
        warm_up(target)
        trace = _run_trace(target, config)
        interference = _run_interference(target, config, PROMPTS[0])
        with WorkerClient(target) as client:
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
