"""``lorastream gateway ...``: run the OpenAI-compatible HTTP gateway."""

from __future__ import annotations

from typing import Any

import typer

from lorastream.cli.common import reported_errors, setup_logging

app = typer.Typer(
    help="Run the HTTP gateway (OpenAI API, operator endpoints, routing over GPU workers).",
    rich_markup_mode=None,
    no_args_is_help=True,
)


@app.command("serve")
def serve(
    host: str | None = typer.Option(
        None, help="Address to bind (0.0.0.0 for all) [default: 127.0.0.1]."
    ),
    port: int | None = typer.Option(None, help="HTTP port (0 picks a free one) [default: 8000]."),
    store: str | None = typer.Option(
        None, help="Adapter store HOST:PORT (or LORASTREAM_STORE) [default: localhost:50051]."
    ),
    worker: list[str] = typer.Option(
        [], "--worker", help="GPU worker HOST:PORT (repeatable; or LORASTREAM_GATEWAY_WORKERS)."
    ),
    token: str | None = typer.Option(
        None,
        help="Bearer token of the operator endpoints, also sent to the store "
        "(or LORASTREAM_GATEWAY_TOKEN / LORASTREAM_TOKEN).",
    ),
    poll_interval: float | None = typer.Option(
        None, "--poll-interval", help="Seconds between worker health/load polls [0.5]."
    ),
    resolve_interval: float | None = typer.Option(
        None, "--resolve-interval",
        help="Seconds between DNS lookups of worker names (a name with several addresses is "
        "several workers); 0 disables [5].",
    ),
    request_timeout: float | None = typer.Option(
        None, "--request-timeout", help="Deadline of one generation in seconds [600]."
    ),
    max_requests_per_worker: int | None = typer.Option(
        None, help="Queue depth at which a worker takes no more requests (then 429) [256]."
    ),
    log_level: str = typer.Option("INFO", help="Logging level."),
) -> None:
    """Serve HTTP until Ctrl-C. Settings also come from LORASTREAM_GATEWAY_* variables."""
    from lorastream.gateway.config import GatewaySettings
    from lorastream.gateway.server import serve as run

    setup_logging(log_level)
    overrides: dict[str, Any] = {
        "host": host, "port": port, "store": store, "workers": worker or None, "token": token,
        "poll_interval_s": poll_interval, "resolve_interval_s": resolve_interval,
        "request_timeout_s": request_timeout,
        "max_requests_per_worker": max_requests_per_worker,
    }
    with reported_errors():
        run(GatewaySettings(**{k: v for k, v in overrides.items() if v is not None}))
