"""Bits every CLI command shares: logging setup, error reporting, the console."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import typer
from rich.console import Console

from lorastream.core.errors import LorastreamError

console = Console(stderr=True)
out = Console()

STORE_OPTION = typer.Option(
    "localhost:50051", "--store", envvar="LORASTREAM_STORE", help="Adapter store HOST:PORT."
)
TOKEN_OPTION = typer.Option(
    None,
    "--token",
    envvar="LORASTREAM_TOKEN",
    help="Bearer token for operator calls (when the server was started with one).",
)


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


@contextlib.contextmanager
def reported_errors() -> Iterator[None]:
    """Print domain errors as one clear line and exit 1 instead of a traceback."""
    try:
        yield
    except LorastreamError as exc:
        console.print(f"[bold red]error[/] ({type(exc).__name__}): {exc}")
        raise typer.Exit(1) from None
