"""No docstring, comment or help text in ``lorastream/`` quotes a timing or a rate.

Measurements go stale: they live in docs/notes/ (or on the generated benchmark page), and the
code points there ("measured: docs/notes/x.md, <section>"). This test reads every string and
comment token of the package (tokenize) outside ``lorastream/bench/``, whose benchmarks describe
measurements by design, and fails on a number followed by a unit of time or rate, or on a
speed-up factor:

    # ~70 us per call at decode shapes          <- fails
    # measured: docs/notes/cpu-kernels.md, ...  <- passes
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lorastream"
EXEMPT_DIRS = {PACKAGE / "bench"}
GENERATED = re.compile(r"_pb2(_grpc)?\.pyi?$")
FIGURE = re.compile(
    r"\b\d[\d.,]* ?(?:ms|µs|us|GB/s|MB/s|tok/s)\b"  # 70 us, 2 GB/s, 0.5 ms/token
    r"|\b\d[\d.]*(?:×|x (?:slower|faster))"  # 2.5×, 4-14x slower
)
# Files with figures still to move, each with its reason; shrink this list, never grow it.
ALLOWED = {
    "lorastream/worker/loading/device_tier.py": "a worked example of the hold rule, not a run",
    "lorastream/worker/service/config.py": "--load-share's cap (50 ms) is a bound it sets",
    "lorastream/cli/bench_serving.py": "bench pool's help states its goal (p99 <= 50 ms)",
}


def figures(path: Path) -> list[str]:
    """``line: text`` of each string or comment token of ``path`` that quotes a figure."""
    found = []
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    for token in tokens:
        if token.type in (tokenize.STRING, tokenize.COMMENT) and FIGURE.search(token.string):
            found.append(f"{token.start[0]}: {FIGURE.search(token.string).group(0)}")  # type: ignore[union-attr]  # searched just above
    return found


def test_no_docstring_or_comment_outside_the_benchmarks_quotes_a_measurement() -> None:
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if GENERATED.search(path.name) or any(d in path.parents for d in EXEMPT_DIRS):
            continue
        if relative in ALLOWED:
            continue
        if found := figures(path):
            offenders[relative] = found
    assert not offenders, (
        "move these measurements to docs/notes/ and point there (docs/notes/x.md, <section>): "
        f"{offenders}")


def test_the_allow_list_names_only_files_that_still_need_it() -> None:
    stale = [name for name in ALLOWED if not figures(ROOT / name)]
    assert not stale, f"nothing left to move in {stale}: drop them from ALLOWED"


def test_the_check_sees_a_figure_in_a_comment_and_a_docstring(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text('"""Takes ~70 us a call."""\nx = 1  # 2.5× faster\ny = "%.1f ms"\n')
    assert figures(sample) == ["1: 70 us", "2: 2.5×"]
