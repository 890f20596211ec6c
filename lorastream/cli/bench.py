"""``lorastream bench ...``: benchmarks that print JSON."""

from __future__ import annotations

import json

import typer

from lorastream.cli.common import console, out, setup_logging

app = typer.Typer(
    help="Benchmarks; each prints one JSON document with its comparison.",
    rich_markup_mode=None,
    no_args_is_help=True,
)


@app.command("transfer")
def transfer(
    adapter_mb: int = typer.Option(96, help="Size of the synthetic adapter streamed (MB)."),
    chunk_bytes: int = typer.Option(1 << 20, help="Stream chunk size in bytes."),
    repeats: int = typer.Option(
        15, help="Rounds; each streams bare, store and verified once. Medians are reported."
    ),
    log_level: str = typer.Option("WARNING", help="Logging level."),
) -> None:
    """Store stream vs a bare gRPC stream of the same bytes on loopback (goal: >= 0.8x)."""
    from lorastream.bench.transfer import run_transfer_bench

    setup_logging(log_level)
    result = run_transfer_bench(adapter_mb=adapter_mb, chunk_bytes=chunk_bytes, repeats=repeats)
    out.print_json(json.dumps(result))


@app.command("engine")
def engine(
    model: str = typer.Option("default", help="Base model: default, a checkpoint dir or Hub id."),
    adapters: int = typer.Option(32, help="Distinct adapters in the batch."),
    rank: int = typer.Option(16, help="Rank of every adapter (all linear projections)."),
    prompts: int = typer.Option(32, help="Concurrent prompts (the batch)."),
    new_tokens: int = typer.Option(32, help="Tokens generated per prompt."),
    repeats: int = typer.Option(3, help="Runs per side; the best is reported."),
    peft: bool = typer.Option(True, "--peft/--no-peft", help="Also run HF transformers + PEFT."),
    log_level: str = typer.Option("WARNING", help="Logging level."),
) -> None:
    """Decode tok/s: engine with N adapters vs base only vs HF+PEFT (goals: >= 0.85x, >= 2.5x)."""
    from lorastream.bench.engine import run_engine_bench

    setup_logging(log_level)
    result = run_engine_bench(
        model=model, adapters=adapters, rank=rank, prompts=prompts, new_tokens=new_tokens,
        repeats=repeats, include_peft=peft,
    )
    out.print_json(json.dumps(result))


@app.command("kernels")
def kernels(
    dtype: str = typer.Option("bfloat16", help="bfloat16 or float16."),
    repeat: int = typer.Option(50, help="Timed launches per point."),
) -> None:
    """Triton SGMV shrink+expand vs the base layer's torch.mm on Llama-3-8B shapes (needs CUDA;
    unmeasured on the CPU-only development machines)."""
    import torch

    from kernels.bench import run_kernel_bench

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
    rate: float = typer.Option(0.5, help="Poisson arrival rate, requests per second."),
    requests: int = typer.Option(32, help="Requests in the trace."),
    popularity: str = typer.Option("zipf:1.2", help="distinct, uniform or zipf:ALPHA."),
    max_tokens: int = typer.Option(32, help="Tokens generated per request."),
    background: int = typer.Option(4, help="Long base-model streams in the interference part."),
    seed: int = typer.Option(0, help="Seed of the request trace."),
    log_level: str = typer.Option("WARNING", help="Logging level."),
) -> None:
    """Poisson trace over cold adapters with overlapped loading on, then off (goals: TTFT p50
    on <= 0.5x off; running streams' ITL p99 during loads <= 1.2x without loads)."""
    from lorastream.bench.serve import ServeConfig, run_serve_bench

    setup_logging(log_level)
    config = ServeConfig(
        model=model, adapters=adapters, slots=slots, rank=rank, rate=rate, requests=requests,
        popularity=popularity, max_tokens=max_tokens, background=background, seed=seed,
    )
    out.print_json(json.dumps(run_serve_bench(config)))
