"""``lorastream store ...``: run the adapter store."""

from __future__ import annotations

import typer

from lorastream.cli.common import LOG_LEVEL_OPTION, reported_errors, setup_logging
from lorastream.cli.settings_flags import with_settings
from lorastream.store.config import StoreSettings

app = typer.Typer(
    help="Run the adapter store (stages adapters, streams their tensors).",
    rich_markup_mode=None,
    no_args_is_help=True,
)


@app.command("serve")
@with_settings(StoreSettings)
def serve(settings: StoreSettings, log_level: str = LOG_LEVEL_OPTION) -> None:
    """Serve the adapter store over gRPC until Ctrl-C. Each setting is a flag or a variable."""
    from lorastream.store.server import serve as run

    setup_logging(log_level)
    with reported_errors():
        run(settings)
