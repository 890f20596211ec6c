"""The CLI's error lines are printed through rich, whose markup reads ``[bench]`` as a tag and
drops it: every message that holds square brackets is rendered here and compared as text.

``lorastream.cli.common.refuse`` and ``reported_errors`` escape what they print; a message printed
any other way must be escaped by hand, or it loses its brackets (``pip install 'lorastream')``).
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from lorastream.cli.common import refuse, reported_errors
from lorastream.cli.main import app
from lorastream.core.errors import InvalidArgument

CLI = Path(__file__).resolve().parents[2] / "lorastream" / "cli"
REAL_FIND_SPEC = importlib.util.find_spec


def _without(*modules: str) -> Callable[..., object]:
    def find_spec(name: str, *args: object) -> object:
        return None if name in modules else REAL_FIND_SPEC(name, *args)  # type: ignore[arg-type]  # find_spec's own arguments, passed on
    return find_spec


def _stderr(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(app, args, env={"COLUMNS": "400"})
    return result.exit_code, " ".join(result.stderr.split())


@pytest.mark.parametrize(("args", "missing", "expected"), [
    (["bench", "registry"], ("tqdm",),
     "error: lorastream bench needs the bench dependencies (missing: tqdm); install them "
     "with `make bench` or `pip install -r requirements-dev.lock` (or: pip install "
     "'lorastream[bench]')"),
    (["bench", "push"], ("moto",),
     "error: lorastream bench push needs moto's S3 server; install it with `pip install -r "
     "requirements-dev.lock` (or: pip install 'moto[server]')"),
    (["bench", "registry", "--counts", "[1],2"], (),
     "error: --counts '[1],2': give integers separated by commas"),
], ids=["bench-extra", "push-moto", "counts"])
def test_an_error_with_brackets_prints_them(
    monkeypatch: pytest.MonkeyPatch, args: list[str], missing: tuple[str, ...], expected: str
) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", _without(*missing))
    code, stderr = _stderr(args)
    assert (code, stderr) == (2, expected)


def test_refused_and_reported_errors_keep_their_brackets() -> None:
    probe = typer.Typer()

    @probe.command()
    def fail(domain: bool = False) -> None:
        if domain:
            with reported_errors():
                raise InvalidArgument("adapter [a]: rank [64] > max_lora_rank")
        refuse(["--flag [x]: expected [y]"])

    refused = CliRunner().invoke(probe, [])
    reported = CliRunner().invoke(probe, ["--domain"])
    assert (refused.exit_code, refused.stderr.strip()) == (2, "error: --flag [x]: expected [y]")
    assert (reported.exit_code, reported.stderr.strip()) == (
        1, "error (InvalidArgument): adapter [a]: rank [64] > max_lora_rank")


def _error_prints(tree: ast.AST) -> list[int]:
    """Lines of ``console.print``/``out.print`` calls that format values into rich markup."""
    lines = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "print" and isinstance(node.func.value, ast.Name)
                and node.func.value.id in ("console", "out") and node.args):
            continue
        if any(k.arg == "markup" for k in node.keywords):
            continue
        first = node.args[0]
        values = [v.value for v in first.values if isinstance(v, ast.FormattedValue)] if (
            isinstance(first, ast.JoinedStr)) else []
        escaped = all(isinstance(v, ast.Call) and getattr(v.func, "id", "") == "escape"
                      for v in values)
        if isinstance(first, ast.JoinedStr) and not escaped:
            lines.append(node.lineno)
        elif isinstance(first, ast.Constant) and "error" in str(first.value):
            lines.append(node.lineno)  # an error line not through refuse()
    return lines


@pytest.mark.parametrize("module", sorted(CLI.glob("*.py")), ids=lambda p: p.name)
def test_no_cli_message_formats_an_unescaped_value_into_markup(module: Path) -> None:
    """A value in an f-string given to rich is escaped, or the call says markup=False; an error
    goes through refuse() or reported_errors(), which escape it."""
    found = _error_prints(ast.parse(module.read_text()))
    assert not found, f"{module.name}: lines {found}: escape() the value or pass markup=False"
