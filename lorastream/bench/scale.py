"""Results at scale: one store holding many adapters, the same workload served over 10, 100,
1000 and 10,000 of them, and HF transformers + PEFT on the same requests as the peer.

1. **registration**: ``max(counts)`` synthetic adapters (``s0``, ``s1``, ...; ranks cycling
   through ``ranks`` on ``targets``; fp16) are generated in memory and pushed to the store
   (``push_state_dict``, the UploadAdapter RPC; four in flight), so nothing is written but the
   store's copy. The default mix (ranks 2, 4, 8 on q_proj and v_proj: 0.54 MB each on the
   default model) is the same at every count and puts 10,000 adapters in 5.4 GB, inside the
   store's default 20 GiB budget; pushing them takes about 2-3 minutes on 2 cores (74/s).
2. **per count N**: a fresh worker (cold: no adapter resident) replays one Poisson trace whose
   arrival times and prompts are the same for every N; only the adapter column differs: zipf
   popularity over ``s0..s{N-1}``. The arrival rate is above the worker's capacity, so throughput
   measures capacity and TTFT includes queueing. The counts take turns for ``repeats`` rounds
   and each reports its best round (every round's throughput is kept): on this shared machine
   one round of the same work moved by over 20%, more than the loss being measured. Reported:
   throughput, TTFT / ITL / end-to-end percentiles and raw samples, and the worker's adapter
   hits, misses and evictions.
3. **peer**: HF + PEFT serves the largest N's requests in static mixed-adapter batches (see
   :mod:`lorastream.bench.peft_peer`), with those adapters pulled from the same store.

The headline figures are the throughput loss from the smallest to the largest N (goal <= 10%;
S-LoRA reports 8.05 -> 7.61 req/s from 5 to 2000 adapters on an A100) and lorastream's tok/s at
the largest N over PEFT's.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from lorastream.bench.harness import (
    TraceEntry,
    free_port,
    make_shared_arrival_trace,
    replay,
    running,
    running_store,
    summarise,
    warm_up,
)
from lorastream.bench.machine import command_line, machine_info
from lorastream.bench.peft_peer import fetch_peft_dirs, run_peft_peer
from lorastream.bench.synthetic import (
    BaseShape,
    adapter_nbytes,
    checkpoint_shape,
    resolve_model_checkpoint,
    synthetic_lora,
)
from lorastream.core.generation import SamplingParams
from lorastream.core.push import push_state_dict
from lorastream.core.store_client import StoreClient
from lorastream.core.worker_client import WorkerClient

PEFT_NOTE = (
    "PEFT runs offline: every request is available at t=0 and batches are full, while lorastream "
    "replays Poisson arrivals; PEFT's adapters are pulled from the store beforehand (not timed), "
    "its load_adapter calls are timed. Both favour PEFT."
)


@dataclass(frozen=True)
class ScaleConfig:
    model: str = "default"
    counts: tuple[int, ...] = (10, 100, 1000, 10000)
    # Adapter i has rank ranks[i % len(ranks)], on targets: the same mix at every count, small
    # enough that 10,000 fit the store's default 20 GiB disk budget (0.54 MB each, 5.4 GB).
    ranks: tuple[int, ...] = (2, 4, 8)
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    rate: float = 8.0  # requests per second, above the worker's capacity
    requests: int = 96
    popularity: str = "zipf:1.5"
    max_tokens: int = 32
    slots: int = 16
    peft: bool = True
    peft_batch: int = 32  # the worker's default --max-batch-size
    repeats: int = 2  # rounds over all counts; each count reports its best round
    host_cache_bytes: int = 1 << 30
    kv_cache_bytes: int = 512 << 20
    seed: int = 0


def adapter_name(index: int) -> str:
    return f"s{index}"


def register_adapters(store: str, config: ScaleConfig, shape: BaseShape,
                      parallel: int = 4) -> dict[str, object]:
    """Push ``max(counts)`` synthetic adapters from memory (UploadAdapter, as a training loop
    would), ``parallel`` at a time: making one overlaps the store's staging of another, which
    waits on its fsyncs. Nothing is written but the store's own copy."""
    count = max(config.counts)

    def register(client: StoreClient, i: int) -> tuple[float, float, int]:
        rank = config.ranks[i % len(config.ranks)]
        t = time.perf_counter()
        tensors, lora_config = synthetic_lora(
            shape, rank=rank, targets=config.targets, dtype=torch.float16,
            seed=config.seed * 1_000_003 + i,
        )
        t_made = time.perf_counter()
        push_state_dict(client, adapter_name(i), tensors, lora_config, )
        t_staged = time.perf_counter()
        bar.update()
        return t_made - t, t_staged - t_made, adapter_nbytes(shape, rank, config.targets, 2)

    start = time.perf_counter()
    with StoreClient(store) as client, tqdm(
        total=count, desc="registering adapters", unit="adapter", file=sys.stderr, leave=False,
    ) as bar, ThreadPoolExecutor(parallel) as pool:
        timings = list(pool.map(lambda i: register(client, i), range(count)))
    elapsed = time.perf_counter() - start
    return {
        "adapters": count,
        "parallel": parallel,
        "method": "push from memory (UploadAdapter)",
        "staged_mb": round(sum(t[2] for t in timings) / 1e6, 1),
        "adapter_mb_mean": round(sum(t[2] for t in timings) / count / 1e6, 3),
        "seconds": round(elapsed, 1),
        "registrations_per_s": round(count / elapsed, 1) if elapsed > 0 else None,
        "generate_ms_mean": round(sum(t[0] for t in timings) / count * 1000, 1),
        "push_ms_mean": round(sum(t[1] for t in timings) / count * 1000, 1),
    }


def _load_stats(metrics_port: int) -> dict[str, object]:
    """The worker's adapter hit/miss/eviction counters and store fetches, from /metrics."""
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            tier = sample.labels.get("tier")
            values[f"{sample.name}:{tier}" if tier else sample.name] = sample.value
    prefix = "lorastream_worker_adapter_"

    def tiers(kind: str) -> dict[str, int]:
        return {t: int(values.get(f"{prefix}{kind}_total:{t}", 0)) for t in ("device", "host")}

    fetches = int(values.get(f"{prefix}fetch_seconds_count", 0))
    fetch_sum = values.get(f"{prefix}fetch_seconds_sum", 0.0)
    return {
        "hits": tiers("hits"),
        "misses": tiers("misses"),
        "evictions": tiers("evictions"),
        "store_fetches": fetches,
        "fetch_ms_mean": round(fetch_sum / fetches * 1000, 1) if fetches else None,
        "load_failures": int(values.get(f"{prefix}load_failures_total", 0)),
    }


def _run_count(
    config: ScaleConfig, count: int, trace: list[TraceEntry], store: str
) -> dict[str, object]:
    """Replay ``trace`` (over ``count`` adapters) against a fresh worker."""
    port, metrics_port = free_port(), free_port()
    args = [
        "worker", "serve", "--model", config.model, "--served-model-name", "base",
        "--port", str(port), "--store", store, "--max-loras", str(config.slots),
        "--max-lora-rank", str(max(config.ranks)), "--lora-overlap-loading",
        "--host-cache-bytes", str(config.host_cache_bytes),
        "--kv-cache-bytes", str(config.kv_cache_bytes), "--metrics-port", str(metrics_port),
    ]
    target = f"127.0.0.1:{port}"
    params = SamplingParams(max_tokens=config.max_tokens, ignore_eos=True)
    with running(args, port):
        warm_up(target)
        results, start = replay(target, trace, params, adapter_name)
        with WorkerClient(target) as client:
            stats = client.stats()
        loads = _load_stats(metrics_port)
    return {
        "adapters": count,
        "distinct_adapters_requested": len({adapter for _, adapter, _ in trace}),
        **summarise(results, start),
        "worker": {
            **loads,
            "device_slots": stats.device_slots_total,
            "host_mb_used": round(stats.host_bytes_used / 1e6, 1),
        },
    }


def _best_round(rounds: list[dict[str, object]]) -> dict[str, object]:
    """The round with the highest throughput (the usual choice on a shared machine), with
    every round's throughput kept beside it."""
    def throughput(run: dict[str, object]) -> float:
        value = run["throughput_req_s"]
        return float(value) if isinstance(value, int | float) else 0.0

    best = max(rounds, key=throughput)
    return {**best, "rounds": len(rounds),
            "throughput_req_s_rounds": [run["throughput_req_s"] for run in rounds]}


def _ratio(a: object, b: object, digits: int = 3) -> float | None:
    if isinstance(a, int | float) and isinstance(b, int | float) and b:
        return round(a / b, digits)
    return None


def run_scale_bench(config: ScaleConfig) -> dict[str, object]:
    counts = sorted(set(config.counts))
    load_before = os.getloadavg()[0]
    shape = checkpoint_shape(config.model)
    store_port = free_port()
    store = f"127.0.0.1:{store_port}"
    c = config
    traces = {  # built first: a bad --popularity fails before the long registration
        n: make_shared_arrival_trace(n, c.popularity, c.rate, c.requests, c.seed) for n in counts
    }
    requests = [(adapter_name(a), q) for _, a, q in traces[counts[-1]]]  # for PEFT
    runs: list[dict[str, object]] = []
    peft: dict[str, object] | None = None
    dirs: dict[str, Path] = {}
    with tempfile.TemporaryDirectory(prefix="lorastream-scale-") as tmp:
        root = Path(tmp)
        with running_store(root / "store", store_port):
            registration = register_adapters(store, config, shape)
            rounds: dict[int, list[dict[str, object]]] = {n: [] for n in counts}
            for _ in range(config.repeats):  # counts take turns: a slow spell hits them all
                for count in counts:
                    rounds[count].append(_run_count(config, count, traces[count], store))
            runs = [_best_round(rounds[count]) for count in counts]
            if config.peft:
                names = sorted({name for name, _ in requests})
                dirs = fetch_peft_dirs(store, names, root / "peft")
        if config.peft:  # after the store has stopped: PEFT runs alone
            peft = run_peft_peer(
                resolve_model_checkpoint(config.model), requests, dirs,
                max_tokens=config.max_tokens, batch=config.peft_batch,
            )
    low, high = runs[0], runs[-1]
    loss = _ratio(high["throughput_req_s"], low["throughput_req_s"])
    result: dict[str, object] = {
        "benchmark": "scale",
        "command": command_line(),
        "machine": machine_info(),
        # Other processes on the cores distort every figure, PEFT's most (its threads spin):
        # a load average near 0 before the start is a clean run.
        "load_average_1m_at_start": round(load_before, 2),
        "config": asdict(config),
        "registration": registration,
        "runs": runs,
        "throughput_loss_max_vs_min": round(1 - loss, 3) if loss is not None else None,
        "goal_throughput_loss": "<= 0.10",
        "ttft_p50_max_vs_min": _ratio(
            high["ttft_ms"]["p50"], low["ttft_ms"]["p50"]  # type: ignore[index]  # runs: JSON-like dicts, this value a dict
        ),
    }
    if peft is not None:
        result["peft"] = {
            **peft,
            "adapters": counts[-1],
            "adapter_source": "pulled from the store into PEFT directories (fp16), before timing",
            "note": PEFT_NOTE,
        }
        result["lorastream_vs_peft"] = _ratio(high["throughput_tok_s"], peft["throughput_tok_s"], 2)
    return result
