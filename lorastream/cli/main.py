"""``lorastream``: one command line for the whole system."""

from __future__ import annotations

import typer

from lorastream import __version__
from lorastream.cli import adapters, bench, complete, store, worker

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
app.add_typer(bench.app, name="bench")
app.command("complete")(complete.complete)


@app.command("version")
def version() -> None:
    """Print the lorastream version."""
    typer.echo(__version__)


@app.command("up")
def up(
    port: int = typer.Option(50051, help="Adapter store port."),
    log_level: str = typer.Option("INFO", help="Logging level."),
) -> None:
    """Start the stack on this machine (for now: the adapter store) until Ctrl-C."""
    from lorastream.cli.common import setup_logging
    from services.adapter_store.config import StoreSettings
    from services.adapter_store.server import serve

    setup_logging(log_level)
    typer.echo(
        f"adapter store on localhost:{port}; try:\n"
        f"  lorastream adapters preload ./my-peft-adapter --name my-adapter --store localhost:{port}\n"
        f"  lorastream adapters ls --store localhost:{port}"
    )
    serve(StoreSettings(port=port))


if __name__ == "__main__":
    app()
