"""What every ``lorastream bench`` command shares: ``--output``, the bench extra's check, and
printing the result JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import typer

from lorastream.cli.common import out, refuse

OUTPUT_OPTION = typer.Option(
    None, "--output", help="Also write the result JSON to this file (directories are created)."
)


# The `bench` extra of pyproject.toml (in requirements-dev.lock), which `make up` does not install.
BENCH_MODULES = ("peft", "psutil", "tqdm")  # the page generator (benchpage/) adds matplotlib


def require_bench_extra() -> None:
    """Exit with one clear line when the benchmark dependencies are not installed."""
    missing = [m for m in BENCH_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        refuse([
            f"lorastream bench needs the bench dependencies (missing: {', '.join(missing)}); "
            "install them with `make bench` or `pip install -r requirements-dev.lock` (or: "
            "pip install 'lorastream[bench]')"
        ])


def print_result(result: dict[str, object], output: Path | None) -> None:
    """Print the result JSON; with ``--output``, also write it to that file."""
    text = json.dumps(result)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(result, indent=2) + "\n")
    out.print_json(text)
