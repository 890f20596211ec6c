"""Bits every CLI command shares: logging setup, error reporting, the console."""

from __future__ import annotations

import contextlib
import logging
import shlex
from collections.abc import Iterable, Iterator
from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape

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

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def refuse(problems: Iterable[str]) -> NoReturn:
    """Report what is wrong with the command line or the environment, one line each, and exit 2
    (a usage error's code) instead of a traceback."""
    for problem in problems:
        console.print(f"[bold red]error[/]: {escape(problem)}", soft_wrap=True)
    raise typer.Exit(2)


def _log_level(value: str) -> str:
    if value.upper() not in LOG_LEVELS:
        refuse([f"--log-level {shlex.quote(value)}: expected one of {', '.join(LOG_LEVELS)}"])
    return value.upper()


LOG_LEVEL_OPTION = typer.Option(
    "INFO", "--log-level", metavar="[" + "|".join(LOG_LEVELS) + "]", callback=_log_level,
    help="Logging level (any case).",
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
        console.print(
            f"[bold red]error[/] ({type(exc).__name__}): {escape(str(exc))}", soft_wrap=True
        )
        raise typer.Exit(1) from None
