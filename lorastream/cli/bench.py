"""``lorastream bench ...``: benchmarks that print JSON (the serving ones are in
``bench_serving.py``, registered here in the order of ``--help``)."""

from __future__ import annotations

import importlib.util
import json
import signal
import sys
from pathlib import Path
from types import FrameType

import typer

from lorastream.cli import bench_serving
from lorastream.cli.bench_common import OUTPUT_OPTION, print_result, require_bench_extra
from lorastream.cli.common import out, refuse, setup_logging

app = typer.Typer(
    help="Benchmarks; each prints one JSON document with its comparison.",
    rich_markup_mode=None,
    no_args_is_help=True,
)


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    sys.exit(128 + signum)


@app.callback()
def bench_main() -> None:
    """Benchmarks; each prints one JSON document with its comparison."""
    # SIGTERM unwinds like Ctrl-C: the benchmarks' context managers stop the stores, workers and
    # gateways they spawned, which a bare SIGTERM would leave running without their parent.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)


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
        refuse([f"--counts {counts!r}: give integers separated by commas"])
    if not parsed or min(parsed) < 1:
        refuse(["--counts: every count must be >= 1"])
    print_result(run_registry_bench(parsed, registrations, json_registrations,
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
    print_result(run_grammar_bench(chosen, repeats), output)


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
    print_result(result, output)


@app.command("engine")
def engine(
    model: str = typer.Option(
        "default", help="Base model: default, gemma3-270m, qwen2.5-coder-0.5b, a checkpoint "
        "dir or Hub id."
    ),
    adapters: int = typer.Option(32, help="Distinct adapters in the batch."),
    rank: int = typer.Option(16, help="Rank of every adapter (all linear projections)."),
    prompts: int = typer.Option(32, help="Concurrent prompts (the batch)."),
    new_tokens: int = typer.Option(32, help="Tokens generated per prompt."),
    repeats: int = typer.Option(3, help="Runs per side; the best is reported."),
    peft: bool = typer.Option(True, "--peft/--no-peft", help="Also run HF transformers + PEFT."),
    peft_new_tokens: int = typer.Option(
        0, help="MoE bases: tokens per prompt on the HF + PEFT side (0: --new-tokens); PEFT "
        "is slow with LoRA on the experts. Decode tok/s is per token either way."
    ),
    quantization: str = typer.Option(
        "none", help="int8, int8-dynamic and/or fp8 (comma-separated): compare each with the "
        "fp32 base in the same run (goals: base-only >= 1.6x, mixed >= 1.3x fp32). fp8 runs "
        "torch's reference loop on a CPU: its tokens are measured, its speed is not a CPU's."
    ),
    dora: bool = typer.Option(
        False, "--dora/--no-dora", help="Also run DoRA adapters with the same A and B as the "
        "plain ones, in the same run (goal: DoRA decode >= 0.9x the plain LoRAs')."
    ),
    tokens: int = typer.Option(
        0, help="Also run the plain adapters each with this many new embedding rows "
        "(TrainableTokens), in the same run (goal: decode >= 0.95x the plain LoRAs')."
    ),
    mix: bool = typer.Option(
        False, "--mix/--no-mix", help="Also run every prompt as a 0.5/0.5 mix of two of the "
        "plain adapters, in the same run (goal: decode >= 0.8x the plain LoRAs')."
    ),
    vocab: str = typer.Option(
        "", help="Vocabulary modules, comma-separated, a side each in the same run: embed-lora, "
        "head-lora (a LoRA of the same rank on embed_tokens / lm_head), saved-embed, saved-head "
        "(a whole saved embed_tokens / lm_head, modules_to_save), each added to the plain "
        "adapters. The page shows each one's decode cost against the plain LoRAs'."
    ),
    saved_adapters: int = typer.Option(
        8, min=1, help="Distinct adapters on the saved-embed / saved-head sides (each holds a "
        "whole vocabulary x hidden matrix)."
    ),
    output: Path | None = OUTPUT_OPTION,
    log_level: str = typer.Option("WARNING", help="Logging level."),
) -> None:
    """Decode tok/s: engine with N adapters vs base only vs HF+PEFT (goals: >= 0.85x, >= 2.5x)."""
    require_bench_extra()
    from lorastream.worker.device.cpu.native_env import tune_native_libraries

    tune_native_libraries()  # as `worker serve` does, before torch loads
    from lorastream.bench.engine import run_engine_bench
    from lorastream.bench.synthetic import VOCAB_KINDS

    kinds = tuple(k.strip() for k in vocab.split(",") if k.strip())
    unknown = sorted(set(kinds) - set(VOCAB_KINDS))
    if unknown:
        raise typer.BadParameter(f"unknown kind {', '.join(unknown)}; known: "
                                 f"{', '.join(VOCAB_KINDS)}", param_hint="--vocab")
    setup_logging(log_level)
    result = run_engine_bench(
        model=model, adapters=adapters, rank=rank, prompts=prompts, new_tokens=new_tokens,
        repeats=repeats, include_peft=peft, quantization=quantization, dora=dora,
        tokens=tokens, mix=mix, peft_new_tokens=peft_new_tokens,
        vocab=kinds, saved_adapters=saved_adapters,
    )
    print_result(result, output)


@app.command("alora")
def alora(
    model: str = typer.Option(
        "default", help="Base model: default, gemma3-270m, a checkpoint dir or Hub id."
    ),
    conversations: int = typer.Option(5, min=1, help="Conversations, one after another."),
    conversation_tokens: int = typer.Option(1000, min=1, help="Tokens of each conversation."),
    reply_tokens: int = typer.Option(16, min=1, help="Tokens of each (greedy) reply."),
    invocation_tokens: int = typer.Option(
        6, min=1, help="Length of the activated LoRA's invocation sequence."
    ),
    rank: int = typer.Option(16, min=1, help="Rank of the synthetic adapters (all linear)."),
    seed: int = typer.Option(0, help="Seed of the prompts and adapters."),
    output: Path | None = OUTPUT_OPTION,
    log_level: str = typer.Option("WARNING", help="Logging level."),
) -> None:
    """An activated LoRA's turn after a base-model turn on the same conversation, prefix
    caching on vs off: its TTFT (goal: on / off <= 0.3x) and the base blocks it takes."""
    require_bench_extra()
    from lorastream.worker.device.cpu.native_env import tune_native_libraries

    tune_native_libraries()  # as `worker serve` does, before torch loads
    from lorastream.bench.alora import AloraConfig, run_alora_bench

    setup_logging(log_level)
    config = AloraConfig(
        model=model, conversations=conversations, conversation_tokens=conversation_tokens,
        reply_tokens=reply_tokens, invocation_tokens=invocation_tokens, rank=rank, seed=seed,
    )
    print_result(run_alora_bench(config), output)


@app.command("moe-checkpoint")
def moe_checkpoint(
    out_dir: Path = typer.Argument(..., help="Directory to write the checkpoint into."),
    hidden: int = typer.Option(1024, help="hidden_size."),
    layers: int = typer.Option(4, help="num_hidden_layers (all sparse)."),
    heads: int = typer.Option(16, help="num_attention_heads."),
    kv_heads: int = typer.Option(2, help="num_key_value_heads."),
    experts: int = typer.Option(64, help="num_experts."),
    top_k: int = typer.Option(8, help="num_experts_per_tok."),
    moe_intermediate: int = typer.Option(384, help="moe_intermediate_size."),
) -> None:
    """A random-weight Qwen3-MoE checkpoint for `bench engine --model DIR` (the default model's
    tokenizer); the defaults scale Qwen3-30B-A3B's proportions down (``MoeShape``)."""
    require_bench_extra()
    from lorastream.bench.engine_moe import MoeShape, make_moe_checkpoint

    shape = MoeShape(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                     experts=experts, top_k=top_k, moe_intermediate=moe_intermediate)
    typer.echo(str(make_moe_checkpoint(out_dir, shape)))


@app.command("prefix")
def prefix(
    model: str = typer.Option(
        "default", help="Base model: default, gemma3-270m, qwen2.5-coder-0.5b, a checkpoint "
        "dir or Hub id."
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
    from lorastream.worker.device.cpu.native_env import tune_native_libraries

    tune_native_libraries()  # as `worker serve` does, before torch loads
    from lorastream.bench.prefix import PrefixConfig, run_prefix_bench

    setup_logging(log_level)
    config = PrefixConfig(
        model=model, adapters=adapters, clients=clients, turns=turns,
        system_tokens=system_tokens, user_tokens=user_tokens, reply_tokens=reply_tokens,
        rank=rank, seed=seed, routing=routing,
    )
    print_result(run_prefix_bench(config), output)


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
        refuse(["this benchmark needs a CUDA GPU; none is available here"])
    result = run_kernel_bench(
        dtype=torch.bfloat16 if dtype == "bfloat16" else torch.float16, repeat=repeat
    )
    out.print_json(json.dumps(result))


app.command("serve")(bench_serving.serve)
app.command("saturate")(bench_serving.saturate)
app.command("scale")(bench_serving.scale)
app.command("fleet")(bench_serving.fleet)
app.command("pool")(bench_serving.pool)


@app.command("push")
def push(
    model: str = typer.Option(
        "default", help="Base model: default, gemma3-270m, qwen2.5-coder-0.5b, a checkpoint "
        "dir or Hub id."
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
        refuse(["lorastream bench push needs moto's S3 server; install it with "
                "`pip install -r requirements-dev.lock` (or: pip install 'moto[server]')"])
    from lorastream.bench.push import PushConfig, run_push_bench

    setup_logging(log_level)
    config = PushConfig(model=model, rank=rank, repeats=repeats, seed=seed)
    print_result(run_push_bench(config), output)


app.command("soak")(bench_serving.soak)
