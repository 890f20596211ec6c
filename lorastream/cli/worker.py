"""``lorastream worker ...``: run a GPU worker."""

from __future__ import annotations

import typer

from lorastream.cli.common import LOG_LEVEL_OPTION, reported_errors, setup_logging
from lorastream.cli.settings_flags import with_settings
from lorastream.worker.service.config import WorkerSettings

app = typer.Typer(
    help="Run a GPU worker (Llama, Mistral, Qwen, Gemma and Phi-3 bases; continuous batching, "
    "batched multi-LoRA).",
    rich_markup_mode=None,
    no_args_is_help=True,
)


@app.command("serve")
@with_settings(WorkerSettings)
def serve(settings: WorkerSettings, log_level: str = LOG_LEVEL_OPTION) -> None:
    """Serve generation over gRPC until Ctrl-C. Each setting is a flag or a variable."""
    from lorastream.worker.device.cpu.native_env import tune_native_libraries

    tune_native_libraries()  # before torch loads (the settings do not load it)
    from lorastream.worker.service.server import serve as run

    setup_logging(log_level)
    with reported_errors():
        run(settings)
