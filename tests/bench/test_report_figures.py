"""No measured figure on the benchmark page is typed by hand: the report modules' prose holds no
number with a unit of measure; each figure comes from a result JSON (an f-string's value).

A number the page states as a goal or as a setting of the run (not a measurement) is listed in
ALLOWED with the reason.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from benchpage import report

BENCH = Path(report.__file__).resolve().parent
# a number and a unit ("503s", HTTP's, is no figure: seconds need their space)
FIGURE = re.compile(
    r"(?<![\w.])[0-9][0-9,]*(\.[0-9]+)?(\s?(×|%|µs|ms|GB/s|MB/s|tok/s)|\ss)(?![\w/])")
ALLOWED = {
    "goal: within 1.2×": "a goal, not a measurement",
    "flat within 20%": "a goal, not a measurement",
    "fetch turns of 2 ms": "the run's setting (--fetch-turn-ms 2)",
    "3 s idle": "the soak's sampling schedule",
}


def _prose(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of every literal string, and of the literal parts of every f-string."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.append((node.lineno, node.value))
    return found


def _typed_figures(source: str) -> list[str]:
    hits = []
    for line, text in _prose(ast.parse(source)):
        for match in FIGURE.finditer(text):
            context = text[max(0, match.start() - 20) : match.end() + 5]
            if not any(allowed in text for allowed in ALLOWED
                       if match.group(0) in allowed):
                hits.append(f"{line}: ...{context}...")
    return hits


@pytest.mark.parametrize("module", sorted(BENCH.glob("report*.py")), ids=lambda p: p.name)
def test_the_page_types_no_measured_figure(module: Path) -> None:
    hits = _typed_figures(module.read_text())
    assert not hits, f"{module.name}: take these from the result JSON or drop them: {hits}"


@pytest.mark.parametrize(("source", "typed"), [
    ('x = "BLAKE3 is about 2.5× faster per core"', True),
    ('x = f"{n} took 0.15 s, nearly all of it"', True),
    ('x = "about 3 µs each"', True),
    ('x = f"BLAKE3 is {ratio(b / s)} faster"', False),
    ('x = "rank 16 of SmolLM2-135M"', False),
    ('x = "the errors and 503s by kind"', False),
    ('x = "(goal: within 1.2×)"', False),
])
def test_a_typed_figure_is_found_and_a_computed_one_is_not(source: str, typed: bool) -> None:
    assert bool(_typed_figures(source)) is typed
