"""``lorastream``: one command line for the whole system."""

from __future__ import annotations

from pathlib import Path

import typer

from lorastream import __version__
from lorastream.cli import adapters, bench, complete, gateway, store, worker
from lorastream.cli.common import LOG_LEVEL_OPTION
from lorastream.stack.launcher import StackConfig

STACK = StackConfig()  # the defaults of `up`, declared once (lorastream/stack/launcher.py)
RESTART = STACK.restart  # and of its worker restarts (lorastream/stack/supervision.py)

app = typer.Typer(
    name="lorastream",
    help=(
        "Serve thousands of LoRA adapters on one base model.\n\n"
        "Start with `lorastream up` (the whole stack on this machine), or run the parts:\n"
        "`lorastream store serve`, then `lorastream adapters preload URI --name NAME`."
    ),
    no_args_is_help=True,
    rich_markup_mode=None,  # help texts show [defaults] and hf://org/repo[@revision] literally
    pretty_exceptions_show_locals=False,
)
app.add_typer(store.app, name="store")
app.add_typer(adapters.app, name="adapters")
app.add_typer(worker.app, name="worker")
app.add_typer(gateway.app, name="gateway")
app.add_typer(bench.app, name="bench")
app.command("complete")(complete.complete)


@app.command("version")
def version() -> None:
    """Print the lorastream version."""
    typer.echo(__version__)


@app.command("up")
def up(
    model: str = typer.Option(
        STACK.model,
        help="Base model: default (embedded SmolLM2-135M-Instruct), gemma3-270m, "
        "qwen2.5-coder-0.5b, a checkpoint directory, a GGUF file or a Hub id (hf://org/name); "
        "mixture-of-experts bases (Qwen3-MoE, Mixtral, Qwen2-MoE) from any of these.",
    ),
    adapter: list[str] = typer.Option(
        [], "--adapter",
        help="NAME=URI to register in the store at start (repeatable); URI is s3://, hf://, or a "
        "local PEFT directory (a relative path is taken from the current directory).",
    ),
    allowed_local_root: list[str] = typer.Option(
        [], "--allowed-local-root", metavar="DIR",
        help="Another directory the store may stage local adapters from (repeatable; the "
        "store's own flag, passed through): vLLM's POST /v1/load_lora_adapter and `lorastream "
        "adapters preload` refuse a local path outside these, the samples and the --adapter "
        "folders.",
    ),
    samples: bool = typer.Option(
        True, "--samples/--no-samples",
        help="With no --adapter on the default model, register the two sample adapters: "
        "shout (answers in UPPER CASE) and french (answers in French).",
    ),
    workers: int = typer.Option(STACK.workers, min=1, help="GPU workers to start."),
    store_port: int = typer.Option(STACK.store_port, help="Adapter store port."),
    worker_port: int = typer.Option(
        STACK.worker_port, help="First worker port (workers count up from it)."
    ),
    port: int = typer.Option(STACK.gateway_port, help="HTTP gateway port (the OpenAI API)."),
    metrics_port: int = typer.Option(
        STACK.metrics_port,
        help="Prometheus metrics of the store on this port, of worker i on PORT+1+i (plain "
        "HTTP, /metrics); the gateway's are on its own port.",
    ),
    token: str | None = typer.Option(
        None, envvar="LORASTREAM_TOKEN",
        help="Operate token of the stack (store, workers, gateway) [default: a fresh one, "
        "printed once and written to --token-file].",
    ),
    token_file: Path | None = typer.Option(
        None, "--token-file",
        help="Where the generated operate token is written (mode 0600) "
        "[default: ~/.cache/lorastream/up-operator-token].",
    ),
    insecure_no_auth: bool = typer.Option(
        False, "--insecure-no-auth/--no-insecure-no-auth",
        help="Generate no tokens: anyone on this machine may stage, delete, load adapters and "
        "download their weights.",
    ),
    tls: bool = typer.Option(
        STACK.tls, "--tls/--no-tls",
        help="Make a throwaway CA and certificates (removed on stop): mutual TLS between the "
        "store, the workers and the gateway, HTTPS at the gateway.",
    ),
    worker_restarts: int = typer.Option(
        RESTART.max_restarts, min=0, metavar="N",
        help="A worker that dies is started again, at most this many times within "
        "--worker-restart-window; one more exit stops the stack (0: the first one does). The "
        "gateway and the store keep serving meanwhile.",
    ),
    worker_restart_window: float = typer.Option(
        RESTART.window_s, min=0, metavar="SECONDS",
        help="The window --worker-restarts counts in; an older restart no longer counts.",
    ),
    worker_restart_delay: float = typer.Option(
        RESTART.backoff_s, min=0, metavar="SECONDS",
        help="Delay before a worker's first restart; it doubles with each restart counted in "
        "the window, up to --worker-restart-max-delay.",
    ),
    worker_restart_max_delay: float = typer.Option(
        RESTART.max_backoff_s, min=0, metavar="SECONDS",
        help="Bound of the delay before a worker's restart.",
    ),
    log_level: str = LOG_LEVEL_OPTION,
) -> None:
    """Start the stack on this machine (the store, the workers, the gateway) until Ctrl-C."""
    from lorastream.cli.common import reported_errors, setup_logging
    from lorastream.stack.examples import examples
    from lorastream.stack.launcher import Stack, StackConfig, stack_adapters
    from lorastream.stack.supervision import RestartPolicy

    setup_logging(log_level)
    with reported_errors():
        config = StackConfig(
            model=model, workers=workers, store_port=store_port, worker_port=worker_port,
            gateway_port=port, metrics_port=metrics_port,
            adapters=stack_adapters(model, adapter, samples),
            allowed_local_roots=allowed_local_root,
            log_level=log_level, token=token, tls=tls, token_file=token_file,
            insecure_no_auth=insecure_no_auth,
            restart=RestartPolicy(worker_restarts, worker_restart_window, worker_restart_delay,
                                  worker_restart_max_delay),
        )
        stack = Stack(config)
        try:
            stack.start()
            typer.echo(examples(stack, "default" if model == "default" else model))
            why = stack.wait()
        finally:
            stack.stop()
    if why is not None:
        typer.echo(f"lorastream up stopped: {why}", err=True)
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
