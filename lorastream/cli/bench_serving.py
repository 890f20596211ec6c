"""``lorastream bench serve|saturate|scale|fleet|soak|pool``: the benchmarks of serving through
processes (a worker, ``lorastream up``, a compose fleet); registered on ``lorastream bench`` by
``lorastream/cli/bench.py``."""

from __future__ import annotations

import random
from pathlib import Path

import typer

from lorastream.cli.bench_common import OUTPUT_OPTION, print_result, require_bench_extra
from lorastream.cli.common import console, refuse, setup_logging


def serve(
    model: str = typer.Option(
        "default", help="Base model of the worker; on a mixture-of-experts checkpoint (`bench "
        "moe-checkpoint`) every adapter also adapts each routed expert, and the result is "
        "serve-moe.",
    ),
    adapters: int = typer.Option(24, help="Distinct adapters in the store (more than slots)."),
    slots: int = typer.Option(8, help="Worker device slots (--max-loras)."),
    rank: int = typer.Option(
        64, help="Rank of every adapter (all linear projections, and the experts of a MoE base)."
    ),
    rate: float = typer.Option(1.0, help="Poisson arrival rate, requests per second."),
    requests: int = typer.Option(32, help="Requests in the trace."),
    popularity: str = typer.Option("zipf:1.2", help="distinct, uniform or zipf:ALPHA."),
    max_tokens: int = typer.Option(32, help="Tokens generated per request."),
    background: int = typer.Option(4, help="Long base-model streams in the interference part."),
    background_tokens: int = typer.Option(
        2000, min=1, help="Tokens each of them asks for: enough to outlast every window (a "
        "window of loads ends early when a stream does)."
    ),
    store_link_mbps: float = typer.Option(
        125.0, help="Cap on the store's egress in MB/s, standing in for the network between "
        "store and worker (125 = 1 Gb/s); 0 streams at loopback speed.",
    ),
    store_link_burst_bytes: int = typer.Option(
        4 << 20, help="Link time, in bytes, the capped store may bank while it is off the CPU "
        "(a socket send buffer draining; 4 MiB is Linux's default TCP maximum).",
    ),
    host_cache_bytes: int = typer.Option(
        1 << 30, min=1, help="Worker host budget for adapters (--host-cache-bytes)."
    ),
    interference_rounds: int = typer.Option(
        6, min=1, help="Rounds of a window with no loads, then one with loads."
    ),
    seed: int = typer.Option(0, help="Seed of the request trace."),
    parts: str = typer.Option(
        "trace,burst,link", help="Parts to run, comma-separated: trace (the Poisson trace, "
        "interference and cold probe, and the CPU variants), loads (the interference and cold "
        "probe alone, overlap on and off), burst (cold adapters beside resident ones), link "
        "(cold adapters one at a time from the capped store).",
    ),
    burst_cold: int = typer.Option(6, min=1, help="Cold adapters asked for at once (burst)."),
    burst_resident: int = typer.Option(4, min=0, help="Resident-adapter requests in the burst."),
    link_rounds: int = typer.Option(6, min=1, help="Cold adapters asked for one at a time (link)."),
    load_shares: str = typer.Option(
        "0,0.15,0.45", help="--load-share values the burst and link workloads also run, "
        "overlap on, beside the worker's default (comma-separated; 0: the share off).",
    ),
    output: Path | None = OUTPUT_OPTION,
    log_level: str = typer.Option("WARNING", help="Logging level."),
) -> None:
    """Poisson trace over cold adapters with overlapped loading on, then off (goals: TTFT p50
    on <= 0.5x off; running streams' ITL p99 during loads <= 1.2x without loads); a burst of
    cold adapters beside resident ones and cold adapters behind a capped link, overlap on (with
    and without --load-share) and off (lorastream/bench/serve_cold.py has their goals). On a
    MoE base: `--parts loads` measures the running streams' ITL p99 during cold expert-LoRA loads
    against none, overlap on and off (serve-moe.json)."""
    require_bench_extra()
    from lorastream.bench.serve import ServeConfig, run_serve_bench

    setup_logging(log_level)
    config = ServeConfig(
        model=model, adapters=adapters, slots=slots, rank=rank, rate=rate, requests=requests,
        popularity=popularity, max_tokens=max_tokens, background=background, seed=seed,
        background_tokens=background_tokens,
        host_cache_bytes=host_cache_bytes, interference_rounds=interference_rounds,
        store_link_mbps=store_link_mbps, store_link_burst_bytes=store_link_burst_bytes,
        parts=tuple(p.strip() for p in parts.split(",") if p.strip()), burst_cold=burst_cold,
        burst_resident=burst_resident, link_rounds=link_rounds,
        cold_shares=tuple(float(x) for x in load_shares.split(",") if x.strip()),
    )
    unknown = set(config.parts) - {"trace", "loads", "burst", "link"}
    if unknown or not config.parts:
        raise typer.BadParameter(f"{parts!r}: use trace, loads, burst and/or link",
                                 param_hint="--parts")
    print_result(run_serve_bench(config), output)


def saturate(
    model: str = typer.Option("default", help="Base model of the worker."),
    requests: int = typer.Option(128, min=1, help="Requests per workload."),
    concurrency: int = typer.Option(16, min=1, help="Streaming requests in flight at a time."),
    prompt_tokens: str = typer.Option("32-64", help="Prompt lengths in token ids, LOW-HIGH."),
    new_tokens: int = typer.Option(32, min=2, help="Tokens generated per request (ignore_eos)."),
    adapters: str = typer.Option(
        "0,8", help="Workloads, comma-separated: adapters named round-robin (0 = base only)."
    ),
    rank: int = typer.Option(16, min=1, help="Rank of the synthetic adapters."),
    engine: bool = typer.Option(True, help="Also run the engine alone on the same requests."),
    output: Path | None = OUTPUT_OPTION,
    log_level: str = typer.Option("WARNING", help="Logging level."),
) -> None:
    """The stack as `up` starts it, saturated through the gateway; prints the CPU busy share and
    served / engine tok/s every run (goals: CPU busy >= 90%; served >= 0.8x the engine)."""
    require_bench_extra()
    from lorastream.bench.saturate import SaturateConfig, run_saturate_bench

    setup_logging(log_level)
    low, _, high = prompt_tokens.partition("-")
    config = SaturateConfig(
        model=model, requests=requests, concurrency=concurrency,
        prompt_tokens=(int(low), int(high or low)), new_tokens=new_tokens,
        adapters=tuple(int(a) for a in adapters.split(",") if a), rank=rank, engine=engine,
    )
    print_result(run_saturate_bench(config, report=console.print), output)


def scale(
    counts: str = typer.Option(
        "10,100,1000,10000",
        help="Adapter counts to serve the workload over, comma-separated; the store holds the "
        "largest count, pushed from memory (ranks cycling 2, 4, 8; fp16; q_proj and v_proj).",
    ),
    rate: float = typer.Option(
        8.0, help="Poisson arrival rate, requests per second (above capacity: throughput "
        "measures capacity)."
    ),
    requests: int = typer.Option(96, help="Requests in the trace (the same for every count)."),
    max_tokens: int = typer.Option(32, help="Tokens generated per request (EOS ignored)."),
    slots: int = typer.Option(16, help="Worker device slots (--max-loras)."),
    popularity: str = typer.Option(
        "zipf:1.5", help="How requests pick among the first COUNT adapters: distinct, uniform "
        "or zipf:ALPHA."
    ),
    peft: bool = typer.Option(
        True, "--peft/--no-peft",
        help="Also serve the largest count's requests with HF transformers + PEFT.",
    ),
    peft_batch: int = typer.Option(
        32, help="PEFT's static mixed-adapter batch size (default: the worker's max batch)."
    ),
    model: str = typer.Option(
        "default", help="Base model: default, gemma3-270m, a checkpoint dir or Hub id."
    ),
    seed: int = typer.Option(0, help="Seed of the trace and of the synthetic adapters."),
    repeats: int = typer.Option(
        2, min=1, help="Rounds over all counts, taking turns; each count reports its best round."
    ),
    output: Path | None = OUTPUT_OPTION,
    log_level: str = typer.Option("WARNING", help="Logging level."),
) -> None:
    """Throughput and TTFT of one zipf workload over 10 to 10,000 adapters in the store, and
    HF+PEFT on the same requests (goal: <= 10% throughput loss from the least to the most)."""
    require_bench_extra()
    from lorastream.bench.harness import adapter_picker
    from lorastream.bench.scale import ScaleConfig, run_scale_bench

    setup_logging(log_level)
    try:
        parsed = tuple(int(c) for c in counts.split(",") if c.strip())
    except ValueError:
        parsed = ()
    if not parsed or min(parsed) < 1:
        raise typer.BadParameter(f"{counts!r}: expected positive integers, e.g. 10,100,1000",
                                 param_hint="--counts")
    try:
        adapter_picker(1, popularity, random.Random())
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--popularity") from err
    config = ScaleConfig(
        model=model, counts=parsed, rate=rate, requests=requests, max_tokens=max_tokens,
        slots=slots, popularity=popularity, peft=peft, peft_batch=peft_batch, seed=seed,
        repeats=repeats,
    )
    print_result(run_scale_bench(config), output)


def fleet(
    adapters: int = typer.Option(100, min=1, help="Adapters registered in the S3 service."),
    requests: int = typer.Option(300, min=1, help="Requests of the trace run once per policy."),
    concurrency: int = typer.Option(8, min=1, help="Requests in flight."),
    zipf_s: float = typer.Option(1.1, min=0.0, help="Zipf exponent of adapter popularity."),
    max_tokens: int = typer.Option(4, min=1, help="Tokens generated per request (EOS ignored)."),
    worker_cpus: float = typer.Option(
        0.6, min=0.05, help="CPU limit of each of the three worker containers (compose cpus)."
    ),
    kill_requests: int = typer.Option(
        200, min=1, help="Requests of the trace one worker is killed under."
    ),
    kill_after_s: float = typer.Option(5.0, min=0.0, help="Seconds into that trace."),
    seed: int = typer.Option(0, help="Seed of the traces and of the synthetic adapters."),
    build: bool = typer.Option(
        True, "--build/--no-build", help="Build the images first (cached layers: about a minute)."
    ),
    output: Path | None = OUTPUT_OPTION,
    log_level: str = typer.Option("WARNING", help="Logging level."),
) -> None:
    """Three CPU worker containers behind the gateway (docker compose): the share of requests
    served by a worker already holding the adapter, affinity routing against random, then one
    worker killed under traffic (time until its adapters are served again). Needs a Docker
    engine and compose v2 (scripts/docker_host_prepare.sh)."""
    require_bench_extra()
    from lorastream.bench.compose import engine_problem
    from lorastream.bench.fleet import FleetConfig, run_fleet_bench

    setup_logging(log_level)
    problem = engine_problem()
    if problem:
        refuse([f"lorastream bench fleet needs Docker: {problem}"])
    config = FleetConfig(
        adapters=adapters, requests=requests, concurrency=concurrency, zipf_s=zipf_s,
        max_tokens=max_tokens, worker_cpus=worker_cpus, kill_requests=kill_requests,
        kill_after_s=kill_after_s, seed=seed, build=build,
    )
    print_result(run_fleet_bench(config), output)


def soak(
    model: str = typer.Option("default", help="Base model of the workers."),
    workers: int = typer.Option(2, min=2, help="Workers behind the gateway (the last one is "
                                "restarted half-way)."),
    adapters: int = typer.Option(100, min=1, help="Synthetic adapters in the store."),
    popularity: str = typer.Option("zipf:1.1", help="distinct, uniform or zipf:ALPHA."),
    duration: float = typer.Option(600.0, min=1.0, help="Seconds of the overloaded phase."),
    load_factor: float = typer.Option(
        2.0, min=0.1, help="Arrival rate of the soak over the closed-loop capacity measured."),
    capacity_seconds: float = typer.Option(30.0, min=1.0, help="Length of the capacity phase."),
    cancel_fraction: float = typer.Option(
        0.25, min=0.0, max=1.0, help="Share of requests closed by the client mid-stream."),
    restart: str = typer.Option(
        "kill", help="How the last worker is stopped half-way: kill (SIGKILL) or term (SIGTERM, "
        "it drains)."),
    greedy_sample: int = typer.Option(
        60, min=0, help="Completed requests sent again quietly to compare outputs."),
    max_tokens: int = typer.Option(32, min=1, help="max_tokens of every request."),
    max_requests_per_worker: int = typer.Option(
        48, min=1, help="The gateway's queue depth per worker (then 429)."),
    settle: float = typer.Option(10.0, min=0.0, help="Idle seconds before the counters are read."),
    seed: int = typer.Option(0, help="Seed of the arrivals, adapters and cancellations."),
    output: Path | None = OUTPUT_OPTION,
    log_level: str = typer.Option("WARNING", help="Logging level."),
) -> None:
    """Overload two workers behind the gateway at 2x capacity, cancel a quarter of the streams,
    restart a worker half-way (goals: no 503 while a worker serves, no wrong output, RSS within
    5% of its post-warm-up level, counters back to 0)."""
    require_bench_extra()
    from lorastream.bench.harness import adapter_picker
    from lorastream.bench.soak import SoakConfig, run_soak_bench

    setup_logging(log_level)
    if restart not in ("kill", "term"):
        raise typer.BadParameter(f"{restart!r}: use kill or term", param_hint="--restart")
    try:
        adapter_picker(1, popularity, random.Random())
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--popularity") from err
    config = SoakConfig(
        model=model, workers=workers, adapters=adapters, popularity=popularity,
        duration_s=duration, load_factor=load_factor, capacity_seconds=capacity_seconds,
        cancel_fraction=cancel_fraction, restart=restart, greedy_sample=greedy_sample,
        max_tokens=max_tokens, max_requests_per_worker=max_requests_per_worker,
        settle_s=settle, seed=seed,
    )
    print_result(run_soak_bench(config), output)


def pool(
    model: str = typer.Option("default", help="Base model of the workers."),
    workers: int = typer.Option(3, min=2, help="Pods (a worker and its OpenAI front each)."),
    adapters: int = typer.Option(32, min=1, help="Synthetic adapters in the store (more than "
                                 "the slots of all workers)."),
    slots: int = typer.Option(2, min=1, help="Device slots of each worker (--max-loras)."),
    host_cache_bytes: int = typer.Option(16 << 20, min=1, help="Host cache of each worker."),
    requests: int = typer.Option(200, min=1, help="Requests of the trace run once per policy."),
    concurrency: int = typer.Option(6, min=1, help="Requests in flight."),
    zipf_s: float = typer.Option(1.1, min=0.0, help="Zipf exponent of adapter popularity."),
    max_tokens: int = typer.Option(8, min=1, help="Tokens generated per request (EOS ignored)."),
    refresh_ms: float = typer.Option(
        50.0, min=1.0, help="The picker's scrape interval of each pod's /metrics."),
    saturate_streams: int = typer.Option(
        24, min=1, help="Streams sent at once to one pod while its /metrics is timed."),
    seed: int = typer.Option(0, help="Seed of the trace, the adapters and the random routing."),
    output: Path | None = OUTPUT_OPTION,
    log_level: str = typer.Option("WARNING", help="Logging level."),
) -> None:
    """Pod-shaped workers on loopback, one zipf trace routed by llm-d-router's endpoint picker
    (re-implemented, scraping /metrics), at random and by lorastream's gateway, each from cold:
    the share of requests served by a worker already holding the adapter, then /metrics latency
    on a saturated worker (goals: picker within 5 points of the gateway and 20 over random;
    p99 <= 50 ms)."""
    require_bench_extra()
    from lorastream.bench.pool import PoolConfig, run_pool_bench

    setup_logging(log_level)
    config = PoolConfig(
        model=model, workers=workers, adapters=adapters, slots=slots,
        host_cache_bytes=host_cache_bytes, requests=requests, concurrency=concurrency,
        zipf_s=zipf_s, max_tokens=max_tokens, refresh_ms=refresh_ms,
        saturate_streams=saturate_streams, seed=seed,
    )
    print_result(run_pool_bench(config), output)
