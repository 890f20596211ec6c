"""``lorastream store ...``: run the adapter store."""

from __future__ import annotations

from pathlib import Path

import typer

from lorastream.cli.common import setup_logging

app = typer.Typer(
    help="Run the adapter store (stages adapters, streams their tensors).",
    rich_markup_mode=None,
    no_args_is_help=True,
)


@app.command("serve")
def serve(
    port: int | None = typer.Option(None, help="gRPC port (0 picks a free one) [default: 50051]."),
    host: str | None = typer.Option(
        None, help="Address to bind (0.0.0.0 for all) [default: 127.0.0.1]."
    ),
    cache_dir: Path | None = typer.Option(
        None, help="Staging directory [default: ~/.cache/lorastream/store]."
    ),
    cache_bytes: int | None = typer.Option(
        None, help="Disk budget in bytes for staged adapters [default: 20 GiB]."
    ),
    chunk_bytes: int | None = typer.Option(None, help="Default stream chunk size [1 MiB]."),
    egress_limit_mbps: float | None = typer.Option(
        None, help="Cap on what all streams send together, MB/s (e.g. 125 for a 1 Gb/s link) "
        "[default: no cap].",
    ),
    egress_burst_bytes: int | None = typer.Option(
        None, help="With --egress-limit-mbps: bytes of idle link time a sender that fell "
        "behind may send at once, like a socket send buffer draining [default: 0, none].",
    ),
    token: str | None = typer.Option(
        None, envvar="LORASTREAM_TOKEN", help="Require this bearer token on operator calls."
    ),
    log_level: str = typer.Option("INFO", help="Logging level."),
) -> None:
    """Serve the adapter store over gRPC until Ctrl-C."""
    from lorastream.store.config import StoreSettings
    from lorastream.store.server import serve as run

    setup_logging(log_level)
    overrides = {
        "port": port,
        "host": host,
        "cache_dir": cache_dir,
        "cache_bytes": cache_bytes,
        "chunk_bytes": chunk_bytes,
        "egress_limit_mbps": egress_limit_mbps,
        "egress_burst_bytes": egress_burst_bytes,
        "token": token,
    }
    run(StoreSettings(**{k: v for k, v in overrides.items() if v is not None}))
