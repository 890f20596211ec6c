"""``lorastream gateway ...``: run the OpenAI-compatible HTTP gateway."""

from __future__ import annotations

import typer

from lorastream.cli.common import LOG_LEVEL_OPTION, reported_errors, setup_logging
from lorastream.cli.settings_flags import with_settings
from lorastream.gateway.config import GatewaySettings

app = typer.Typer(
    help="Run the HTTP gateway (OpenAI API, operator endpoints, routing over GPU workers).",
    rich_markup_mode=None,
    no_args_is_help=True,
)


@app.command("serve")
@with_settings(GatewaySettings)
def serve(settings: GatewaySettings, log_level: str = LOG_LEVEL_OPTION) -> None:
    """Serve HTTP until Ctrl-C. Each setting is a flag or a variable."""
    from lorastream.gateway.server import serve as run

    setup_logging(log_level)
    with reported_errors():
        run(settings)
