"""``lorastream bench ...``: benchmarks that print JSON."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import typer

from lorastream.cli.common import console, out, setup_logging

app = typer.Typer(
    help="Benchmarks; each prints one JSON document with its comparison.",
    rich_markup_mode=None,
    no_args_is_help=True,
)

OUTPUT_OPTION = typer.Option(
    None, "--output", help="Also write the result JSON to this file (directories are created)."
)


# The `bench` extra of pyproject.toml (in requirements-dev.lock), which `make up` does not install.
BENCH_MODULES = ("peft", "psutil", "tqdm", "matplotlib")


def require_bench_extra() -> None:
    """Exit with one clear line when the benchmark dependencies are not installed."""
    missing = [m for m in BENCH_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        console.print(
            f"[red]error[/]: lorastream bench needs the bench dependencies (missing: "
            f"{', '.join(missing)}); install them with `make bench` or "
            "`pip install -r requirements-dev.lock` (or: pip install 'lorastream[bench]')"
        )
        raise typer.Exit(2)


def _print_result(result: dict[str, object], output: Path | None) -> None:
    """Print the result JSON; with ``--output``, also write it to that file."""
    text = json.dumps(result)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(result, indent=2) + "\n")
    out.print_json(text)


@app.command("registry")
def registry(
    counts: str = typer.Option(
        "1000,10000,100000", help="Numbers of names already registered, comma-separated."
    ),
    registrations: int = typer.Option(
        400, min=1, help="Registrations timed at each count (each a durable transaction), in "
        "interleaved rounds of 10 across the counts."
    ),
    json_registrations: int = typer.Option(
        20, min=1, help="Registrations timed for the JSON-rewrite baseline at each count."
    ),
    rpc: bool = typer.Option(
        True, help="Also time registrations through the store's PreloadAdapter RPC at each "
        "count (a store server per count, filled with that many distinct adapters)."
    ),
    rpc_sequence: int = typer.Option(
        2000, min=0, help="PreloadAdapter calls one after another into an empty store; their "
        "last fifth's median over the first's is reported (0: skip)."
    ),
    output: Path | None = OUTPUT_OPTION,
) -> None:
    """Registration cost against the number of names: the store's SQLite registry beside the
    JSON file it replaced (rewritten whole on every registration), in the same run, and the
    same counts through the store's PreloadAdapter RPC end to end."""
    require_bench_extra()
    from lorastream.bench.registry import run_registry_bench

    try:
        parsed = tuple(int(c) for c in counts.split(","))
    except ValueError:
        console.print(f"[red]error[/]: --counts {counts!r}: give integers separated by commas")
        raise typer.Exit(2) from None
    if not parsed or min(parsed) < 1:
        console.print("[red]error[/]: --counts: every count must be >= 1")
        raise typer.Exit(2)
    _print_result(run_registry_bench(parsed, registrations, json_registrations,
                                     rpc_sequence=rpc_sequence, rpc=rpc), output)


@app.command("grammar")
def grammar(
    models: str = typer.Option(
        "default,gemma3-270m", help="Tokenizers to measure, as --model names, comma-separated "
        "(gemma3-270m is skipped when its package is not installed)."
    ),
    repeats: int = typer.Option(5, min=2, help="Walks of each case per engine; the first warms."),
    output: Path | None = OUTPUT_OPTION,
) -> None:
    """Structured outputs: the bitmask cost per step and the compile time of llguidance (what
    the worker uses) beside xgrammar, over the same constraints and tokens, in the same run."""
    require_bench_extra()
    from lorastream.bench.grammar import available_models, run_grammar_bench

    chosen = available_models(tuple(m for m in models.split(",") if m))
    _print_result(run_grammar_bench(chosen, repeats), output)


@app.command("transfer")
def transfer(
    adapter_mb: int = typer.Option(96, help="Size of the synthetic adapter streamed (MB)."),
    chunk_bytes: str = typer.Option(
        "1M", help="Stream chunk size: bytes, or with K/M suffix (binary units)."
    ),
    chunk_sizes: str | None = typer.Option(
        None,
        help="Sweep these chunk sizes instead, e.g. 64K,256K,1M,4M; the 1M point (or the one "
        "nearest it) is also reported at top level.",
    ),
    repeats: int = typer.Option(
        15, min=1, help="Rounds per chunk size; each streams bare, store and verified (one "
        "client per tensor digest) once. Medians are reported."
    ),
    staging_mb: float = typer.Option(
        78, min=0, help="Size of the adapter preloaded from S3 (moto on loopback) against "
        "boto3's own download of it, in a third as many rounds; 0 skips it."
    ),
    output: Path | None = OUTPUT_OPTION,
    log_level: str = typer.Option("WARNING", help="Logging level."),
) -> None:
    """Store stream and verified stream vs a bare gRPC stream of the same bytes on loopback, and
    S3 staging vs boto3 (goals: >= 0.8x, >= 0.8x, >= 0.9x)."""
    require_bench_extra()
    from lorastream.bench.transfer import (
        checked_chunk_sizes,
        parse_size,
        parse_sizes,
        run_transfer_bench,
    )

    try:
        single = parse_size(chunk_bytes)
        sizes = parse_sizes(chunk_sizes) if chunk_sizes is not None else None
        checked_chunk_sizes(sizes or [single])
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    setup_logging(log_level)
    result = run_transfer_bench(
        adapter_mb=adapter_mb, chunk_bytes=single, repeats=repeats, chunk_sizes=sizes,
        staging_mb=staging_mb,
    )
    _print_result(result, output)


@app.command("engine")
def engine(
    model: str = typer.Option(
        "default", help="Base model: default, gemma3-270m, a checkpoint dir or Hub id."
    ),
    adapters: int = typer.Option(32, help="Distinct adapters in the batch."),
    rank: int = typer.Option(16, help="Rank of every adapter (all linear projections)."),
    prompts: int = typer.Option(32, help="Concurrent prompts (the batch)."),
    new_tokens: int = typer.Option(32, help="Tokens generated per prompt."),
    repeats: int = typer.Option(3, help="Runs per side; the best is reported."),
    peft: bool = typer.Option(True, "--peft/--no-peft", help="Also run HF transformers + PEFT."),
    quantization: str = typer.Option(
        "none", help="int8, int8-dynamic and/or fp8 (comma-separated): compare each with the "
        "fp32 base in the same run (goals: base-only >= 1.6x, mixed >= 1.3x fp32). fp8 runs "
        "torch's reference loop on a CPU: its tokens are measured, its speed is not a CPU's."
    ),
    output: Path | None = OUTPUT_OPTION,
    log_level: str = typer.Option("WARNING", help="Logging level."),
) -> None:
    """Decode tok/s: engine with N adapters vs base only vs HF+PEFT (goals: >= 0.85x, >= 2.5x)."""
    require_bench_extra()
    from lorastream.core.native_env import tune_native_libraries

    tune_native_libraries()  # as `worker serve` does, before torch loads
    from lorastream.bench.engine import run_engine_bench

    setup_logging(log_level)
    result = run_engine_bench(
        model=model, adapters=adapters, rank=rank, prompts=prompts, new_tokens=new_tokens,
        repeats=repeats, include_peft=peft, quantization=quantization,
    )
    _print_result(result, output)


@app.command("prefix")
def prefix(
    model: str = typer.Option(
        "default", help="Base model: default, gemma3-270m, a checkpoint dir or Hub id."
    ),
    adapters: int = typer.Option(8, min=1, help="Adapters, each with its own system prompt."),
    clients: int = typer.Option(16, min=1, help="Concurrent clients (one conversation each)."),
    turns: int = typer.Option(4, min=1, help="Turns per conversation."),
    system_tokens: int = typer.Option(1000, min=1, help="Tokens of each system prompt."),
    user_tokens: int = typer.Option(24, min=1, help="Tokens of each user message."),
    reply_tokens: int = typer.Option(32, min=1, help="Tokens of each (greedy) reply."),
    rank: int = typer.Option(8, min=1, help="Rank of the synthetic adapters (all linear)."),
    seed: int = typer.Option(0, help="Seed of the prompts and adapters."),
    routing: bool = typer.Option(
        True, help="Also the chat through the gateway over two workers, its prefix affinity "
        "on and off (--no-routing: the engine parts only)."
    ),
    output: Path | None = OUTPUT_OPTION,
    log_level: str = typer.Option("WARNING", help="Logging level."),
) -> None:
    """Chat traffic with prefix caching on vs off in one run, and prompts that share nothing
    (goals: TTFT p50 <= 0.3x, tokens/s >= 1.3x, no-sharing >= 0.97x, identical outputs); then
    the same chat through the gateway over two workers, prefix affinity on vs off."""
    require_bench_extra()
    from lorastream.core.native_env import tune_native_libraries

    tune_native_libraries()  # as `worker serve` does, before torch loads
    from lorastream.bench.prefix import PrefixConfig, run_prefix_bench

    setup_logging(log_level)
    config = PrefixConfig(
        model=model, adapters=adapters, clients=clients, turns=turns,
        system_tokens=system_tokens, user_tokens=user_tokens, reply_tokens=reply_tokens,
        rank=rank, seed=seed, routing=routing,
    )
    _print_result(run_prefix_bench(config), output)


@app.command("kernels")
def kernels(
    dtype: str = typer.Option("bfloat16", help="bfloat16 or float16."),
    repeat: int = typer.Option(50, help="Timed launches per point."),
) -> None:
    """Triton SGMV shrink+expand vs the base layer's torch.mm on Llama-3-8B shapes (needs CUDA;
    unmeasured on the CPU-only development machines)."""
    import torch

    from lorastream.kernels.bench import run_kernel_bench

    if not torch.cuda.is_available():
        console.print("[red]error[/]: this benchmark needs a CUDA GPU; none is available here")
        raise typer.Exit(2)
    result = run_kernel_bench(
        dtype=torch.bfloat16 if dtype == "bfloat16" else torch.float16, repeat=repeat
    )
    out.print_json(json.dumps(result))


@app.command("serve")
def serve(
    model: str = typer.Option("default", help="Base model of the worker."),
    adapters: int = typer.Option(24, help="Distinct adapters in the store (more than slots)."),
    slots: int = typer.Option(8, help="Worker device slots (--max-loras)."),
    rank: int = typer.Option(64, help="Rank of every adapter (all linear projections)."),
    rate: float = typer.Option(1.0, help="Poisson arrival rate, requests per second."),
    requests: int = typer.Option(32, help="Requests in the trace."),
    popularity: str = typer.Option("zipf:1.2", help="distinct, uniform or zipf:ALPHA."),
    max_tokens: int = typer.Option(32, help="Tokens generated per request."),
    background: int = typer.Option(4, help="Long base-model streams in the interference part."),
    store_link_mbps: float = typer.Option(
        125.0, help="Cap on the store's egress in MB/s, standing in for the network between "
        "store and worker (125 = 1 Gb/s); 0 streams at loopback speed.",
    ),
    store_link_burst_bytes: int = typer.Option(
        4 << 20, help="Link time, in bytes, the capped store may bank while it is off the CPU "
        "(a socket send buffer draining; 4 MiB is Linux's default TCP maximum).",
    ),
    seed: int = typer.Option(0, help="Seed of the request trace."),
    output: Path | None = OUTPUT_OPTION,
    log_level: str = typer.Option("WARNING", help="Logging level."),
) -> None:
    """Poisson trace over cold adapters with overlapped loading on, then off (goals: TTFT p50
    on <= 0.5x off; running streams' ITL p99 during loads <= 1.2x without loads)."""
    require_bench_extra()
    from lorastream.bench.serve import ServeConfig, run_serve_bench

    setup_logging(log_level)
    config = ServeConfig(
        model=model, adapters=adapters, slots=slots, rank=rank, rate=rate, requests=requests,
        popularity=popularity, max_tokens=max_tokens, background=background, seed=seed,
        store_link_mbps=store_link_mbps, store_link_burst_bytes=store_link_burst_bytes,
    )
    _print_result(run_serve_bench(config), output)


@app.command("saturate")
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
    _print_result(run_saturate_bench(config, report=console.print), output)


@app.command("scale")
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
    _print_result(run_scale_bench(config), output)


@app.command("fleet")
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
        console.print(f"[red]error[/]: lorastream bench fleet needs Docker: {problem}")
        raise typer.Exit(2)
    config = FleetConfig(
        adapters=adapters, requests=requests, concurrency=concurrency, zipf_s=zipf_s,
        max_tokens=max_tokens, worker_cpus=worker_cpus, kill_requests=kill_requests,
        kill_after_s=kill_after_s, seed=seed, build=build,
    )
    _print_result(run_fleet_bench(config), output)


@app.command("push")
def push(
    model: str = typer.Option(
        "default", help="Base model: default, gemma3-270m, a checkpoint dir or Hub id."
    ),
    rank: int = typer.Option(
        32, min=1, help="LoRA rank of the pushed adapters (every linear projection, fp16: "
        "19.5 MB at 32 on the default model)."
    ),
    repeats: int = typer.Option(
        5, min=1, help="Timed rounds (push and S3 take turns in each), after one warm-up round."
    ),
    seed: int = typer.Option(0, help="Seed of the synthetic adapters."),
    output: Path | None = OUTPUT_OPTION,
    log_level: str = typer.Option("WARNING", help="Logging level."),
) -> None:
    """An adapter from memory to its first token: push (UploadAdapter) against write-to-S3 then
    preload (moto's S3 server on loopback), in the same run; p50s and their ratio."""
    require_bench_extra()
    if importlib.util.find_spec("moto") is None:
        console.print("[red]error[/]: lorastream bench push needs moto's S3 server; install it "
                      "with `pip install -r requirements-dev.lock` (or: pip install "
                      "'moto[server]')")
        raise typer.Exit(2)
    from lorastream.bench.push import PushConfig, run_push_bench

    setup_logging(log_level)
    config = PushConfig(model=model, rank=rank, repeats=repeats, seed=seed)
    _print_result(run_push_bench(config), output)


@app.command("soak")
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
    _print_result(run_soak_bench(config), output)


@app.command("report")
def report(
    results: Path = typer.Option(
        Path("docs/benchmarks/results"), help="Directory of transfer/engine/serve/scale .json."
    ),
    out_md: Path = typer.Option(Path("docs/BENCHMARKS.md"), "--out", help="Page to write."),
    plots: Path | None = typer.Option(
        None, help="Directory for the PNG plots (default: RESULTS/../plots)."
    ),
    log_level: str = typer.Option("WARNING", help="Logging level."),
) -> None:
    """Write the benchmark page (tables, goal verdicts, plots, commands, machine) from the result
    JSONs; a missing result is shown as not run."""
    require_bench_extra()
    from lorastream.bench.report import write_report

    setup_logging(log_level)
    if not results.is_dir():
        console.print(f"[red]error[/]: --results {results}: no such directory")
        raise typer.Exit(2)
    console.print(f"wrote {write_report(results, out_md, plots)}")
