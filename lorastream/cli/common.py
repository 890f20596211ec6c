"""Bits every CLI command shares: logging setup, error reporting, the console."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import shlex
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar, cast

import typer
from rich.console import Console
from rich.markup import escape

from lorastream.core.errors import LorastreamError

if TYPE_CHECKING:
    from lorastream.core.tls import ClientTLS

console = Console(stderr=True)
out = Console()

STORE_OPTION = typer.Option(
    "localhost:50051", "--store", envvar="LORASTREAM_STORE", help="Adapter store HOST:PORT."
)
WORKER_OPTION = typer.Option(
    "localhost:50052", "--worker", envvar="LORASTREAM_WORKER", help="GPU worker HOST:PORT."
)
TOKEN_OPTION = typer.Option(
    None,
    "--token",
    envvar="LORASTREAM_TOKEN",
    help="Bearer token (operate for changes, read or operate for reads) when the server has "
    "tokens; prefer the variable or --token-file: a flag shows in process listings.",
)
TOKEN_FILE_OPTION = typer.Option(
    None,
    "--token-file",
    envvar="LORASTREAM_TOKEN_FILE",
    help="File holding the bearer token (first line), e.g. the one `lorastream up` wrote.",
)

# TLS to the store or a worker (lorastream/core/tls.py); none given: plaintext.
TLS_CA_OPTION = typer.Option(
    None, "--tls-ca", envvar="LORASTREAM_TLS_CA",
    help="Connect over TLS, trusting this CA certificate (PEM).",
)
TLS_CLIENT_CERT_OPTION = typer.Option(
    None, "--tls-client-cert", envvar="LORASTREAM_TLS_CLIENT_CERT",
    help="Mutual TLS: the certificate (PEM) to present; needs --tls-client-key.",
)
TLS_CLIENT_KEY_OPTION = typer.Option(
    None, "--tls-client-key", envvar="LORASTREAM_TLS_CLIENT_KEY",
    help="Private key (PEM) of --tls-client-cert.",
)


@dataclasses.dataclass(frozen=True)
class Connection:
    """How a command reaches the store (or a worker): its connection options, declared once
    (:func:`connection_options`, :func:`worker_connection_options`) for every command that takes
    them."""

    target: str  # HOST:PORT
    token: str | None = None
    token_file: Path | None = None
    tls_ca: Path | None = None
    tls_client_cert: Path | None = None
    tls_client_key: Path | None = None

    def bearer(self) -> str | None:
        """:func:`client_token` of ``--token`` / ``--token-file`` (inside reported_errors)."""
        return client_token(self.token, self.token_file)

    def tls(self) -> ClientTLS | None:
        """:func:`client_tls` of the ``--tls-*`` flags (inside reported_errors)."""
        return client_tls(self.tls_ca, self.tls_client_cert, self.tls_client_key)


# parameter -> (annotation, option); the first parameter holds the target HOST:PORT
_Options = dict[str, tuple[Any, Any]]
_TLS_OPTIONS: _Options = {
    "tls_ca": (Path | None, TLS_CA_OPTION),
    "tls_client_cert": (Path | None, TLS_CLIENT_CERT_OPTION),
    "tls_client_key": (Path | None, TLS_CLIENT_KEY_OPTION),
}
_STORE_OPTIONS: _Options = {
    "store": (str, STORE_OPTION),
    "token": (str | None, TOKEN_OPTION),
    "token_file": (Path | None, TOKEN_FILE_OPTION),
    **_TLS_OPTIONS,
}
_WORKER_OPTIONS: _Options = {"worker": (str, WORKER_OPTION), **_TLS_OPTIONS}

Command = TypeVar("Command", bound=Callable[..., Any])


def connection_options(command: Command) -> Command:
    """Give ``command`` the store's connection options (``--store``, ``--token``,
    ``--token-file``, ``--tls-ca``, ``--tls-client-cert``, ``--tls-client-key``), after its
    own, and call it with them as ``conn``: a :class:`Connection`. Put it under
    ``@app.command``::

        @app.command("rm")
        @connection_options
        def rm(name: str, conn: Connection) -> None: ...
    """
    return _with_options(command, _STORE_OPTIONS)


def worker_connection_options(command: Command) -> Command:
    """As :func:`connection_options`, for a command that talks to a GPU worker: ``--worker``,
    ``--tls-ca``, ``--tls-client-cert``, ``--tls-client-key`` (``conn.token`` is None)."""
    return _with_options(command, _WORKER_OPTIONS)


def _with_options(command: Command, declared: _Options) -> Command:
    """``command`` with the ``declared`` options after its own, called with them as ``conn``."""
    target, *_ = declared
    own = [p for p in inspect.signature(command, eval_str=True).parameters.values()
           if p.name != "conn"]
    added = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option,
                          annotation=annotation)
        for name, (annotation, option) in declared.items()
    ]

    @functools.wraps(command)
    def with_connection(**kwargs: Any) -> Any:
        options = {name: kwargs.pop(name) for name in declared}
        conn = Connection(options.pop(target), **options)
        return command(conn=conn, **kwargs)

    parameters = [*own, *added]
    # typer reads the signature: the command's own parameters, then the connection options
    with_connection.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]  # mypy's function type has no __signature__; typer reads it
    with_connection.__annotations__ = {p.name: p.annotation for p in parameters}
    return cast(Command, with_connection)


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


def client_tls(ca: Path | None, cert: Path | None, key: Path | None) -> ClientTLS | None:
    """The TLS of ``--tls-ca``/``--tls-client-cert``/``--tls-client-key`` (None: plaintext);
    InvalidArgument naming the flag when a file is missing or wrong (call inside
    :func:`reported_errors`)."""
    from lorastream.core.tls import ClientTLS

    return ClientTLS.from_files(ca, cert, key)


@contextlib.contextmanager
def reported_errors() -> Iterator[None]:
    """Print domain errors as one clear line and exit 1 instead of a traceback."""
    try:
        yield
    except LorastreamError as exc:
        console.print(
            f"[bold red]error[/] ({escape(type(exc).__name__)}): {escape(str(exc))}", soft_wrap=True
        )
        raise typer.Exit(1) from None


def client_token(token: str | None, token_file: Path | None) -> str | None:
    """The bearer token of ``--token`` (or LORASTREAM_TOKEN), else of ``--token-file``;
    InvalidArgument when the file cannot be read (call inside :func:`reported_errors`)."""
    from lorastream.core.auth import read_token_file

    if token or token_file is None:
        return token
    return read_token_file(token_file, "--token-file")
