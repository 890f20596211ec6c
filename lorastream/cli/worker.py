"""``lorastream worker ...``: run a GPU worker."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import typer

from lorastream.cli.common import reported_errors, setup_logging


class OnOff(str, Enum):
    ON = "on"
    OFF = "off"

    @staticmethod
    def flag(value: OnOff | None) -> bool | None:
        """The setting an on/off option gives: None where it was not given."""
        return None if value is None else value is OnOff.ON


class LoaderPriority(str, Enum):
    IDLE = "idle"
    NICE = "nice"


app = typer.Typer(
    help="Run a GPU worker (Llama engine, continuous batching, batched multi-LoRA).",
    rich_markup_mode=None,
    no_args_is_help=True,
)


@app.command("serve")
def serve(
    model: str | None = typer.Option(
        None,
        help="'default' (the embedded SmolLM2-135M-Instruct), an HF checkpoint directory, or a "
        "Hub model id (org/name[@revision]) [default: default].",
    ),
    port: int | None = typer.Option(None, help="gRPC port (0 picks a free one) [default: 50052]."),
    host: str | None = typer.Option(
        None, help="Address to bind (0.0.0.0 for all) [default: 127.0.0.1]."
    ),
    store: str | None = typer.Option(
        None, envvar="LORASTREAM_STORE", help="Adapter store HOST:PORT to fetch adapters from."
    ),
    max_loras: int | None = typer.Option(None, help="Device adapter slots [8]."),
    max_lora_rank: int | None = typer.Option(None, help="Largest adapter rank a slot holds [64]."),
    served_model_name: str | None = typer.Option(
        None, help="Name requests use for the base model [default: the --model value]."
    ),
    max_batch_size: int | None = typer.Option(None, help="Most sequences in one step [32]."),
    max_num_tokens: int | None = typer.Option(None, help="Token budget of one step [512]."),
    max_seq_len: int | None = typer.Option(None, help="Longest prompt + completion [2048]."),
    kv_cache_bytes: int | None = typer.Option(None, help="KV cache budget in bytes [1 GiB]."),
    host_cache_bytes: int | None = typer.Option(
        None,
        help="Host memory budget for adapters in bytes [4 GiB]: one buffer, allocated at start "
        "(pinned on CUDA) and reused by every load.",
    ),
    lora_overlap_loading: OnOff | None = typer.Option(
        None,
        "--lora-overlap-loading",
        help="on: load adapters while the batch keeps decoding; off: load synchronously before "
        "the step (for comparison) [default: on].",
    ),
    loader_priority: LoaderPriority | None = typer.Option(
        None, help="CPU priority of adapter loaders (store fetches, CPU copies): idle "
        "(SCHED_IDLE: only CPU time decoding leaves) or nice (at --loader-nice, for boxes "
        "whose cores never idle) [idle].",
    ),
    loader_nice: int | None = typer.Option(
        None, help="Nice increment of adapter loaders with --loader-priority nice [10]."
    ),
    fetch_threads: int | None = typer.Option(
        None, help="Adapter fetches from the store at once; more share the link, so each "
        "arrives later [1].",
    ),
    fetch_process: OnOff | None = typer.Option(
        None, help="on: store fetches run in a process of their own, at the loader priority, "
        "and land in memory it shares with the worker; off: on threads in the worker [on].",
    ),
    host_memory_prefault: OnOff | None = typer.Option(
        None, help="With the fetch process: on takes and maps the whole --host-cache-bytes at "
        "start, so landing adapters never faults pages in beside decoding; off takes pages "
        "as adapters land [on].",
    ),
    copy_turn_ms: float | None = typer.Option(
        None, help="CPU only: milliseconds the copies of adapters into the slots may run between "
        "two decode steps (never during one); 0 runs them beside the steps [20].",
    ),
    fetch_turn_ms: float | None = typer.Option(
        None, help="CPU only: while a store fetch is in flight, milliseconds the engine leaves "
        "the cores to the idle-priority loaders before each decode step: cold adapters load "
        "faster under load, running streams slow a little (2 loads a rank-64 adapter ~3x "
        "faster beside 4 streams); 0 gives loaders only what decoding leaves [0].",
    ),
    bind_compute_threads: OnOff | None = typer.Option(
        None, help="CPU only: on binds the engine's compute threads one per core when there is "
        "one per CPU of the process; off leaves their placement to the kernel [on].",
    ),
    prefetch_depth: int | None = typer.Option(
        None, help="Waiting requests whose adapters are loaded ahead of admission [8]."
    ),
    lora_backend: str | None = typer.Option(None, help="LoRA backend: torch or triton [torch]."),
    device: str | None = typer.Option(None, help="auto, cpu or cuda[:N] [auto]."),
    dtype: str | None = typer.Option(
        None, help="auto (fp32 on CPU, bf16 on CUDA), float32, float16 or bfloat16 [auto]."
    ),
    model_cache_dir: Path | None = typer.Option(
        None, help="Where the default model is converted once [~/.cache/lorastream/models]."
    ),
    metrics_port: int | None = typer.Option(
        None, help="Serve Prometheus metrics on http://HOST:PORT/metrics (off by default)."
    ),
    log_level: str = typer.Option("INFO", help="Logging level."),
) -> None:
    """Serve generation over gRPC until Ctrl-C. Settings also come from LORASTREAM_WORKER_* vars."""
    from lorastream.core.openmp import tune_openmp_waits

    tune_openmp_waits()  # before torch loads
    from lorastream.worker.service.config import WorkerSettings
    from lorastream.worker.service.server import serve as run

    setup_logging(log_level)
    overrides = {
        "model": model, "port": port, "host": host, "store": store, "max_loras": max_loras,
        "max_lora_rank": max_lora_rank, "served_model_name": served_model_name,
        "max_batch_size": max_batch_size, "max_num_tokens": max_num_tokens,
        "max_seq_len": max_seq_len, "kv_cache_bytes": kv_cache_bytes,
        "host_cache_bytes": host_cache_bytes,
        "lora_overlap_loading": OnOff.flag(lora_overlap_loading),
        "lora_backend": lora_backend, "device": device, "dtype": dtype,
        "model_cache_dir": model_cache_dir, "metrics_port": metrics_port,
        "prefetch_depth": prefetch_depth, "loader_nice": loader_nice,
        "loader_priority": loader_priority and loader_priority.value,
        "fetch_threads": fetch_threads, "copy_turn_ms": copy_turn_ms,
        "fetch_turn_ms": fetch_turn_ms,
        "fetch_process": OnOff.flag(fetch_process),
        "host_memory_prefault": OnOff.flag(host_memory_prefault),
        "bind_compute_threads": OnOff.flag(bind_compute_threads),
    }
    with reported_errors():
        run(WorkerSettings(**{k: v for k, v in overrides.items() if v is not None}))
