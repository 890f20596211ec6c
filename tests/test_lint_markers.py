"""Every ``noqa`` and ``type: ignore`` in the tree names what it silences and says why, on its line.

ruff (PGH004) refuses a bare ``# noqa`` and mypy (``ignore-without-code``) a bare ``# type:
ignore`` in the packages it checks; neither asks for a reason, and mypy does not read the tests,
the benchmarks or the scripts. This test reads every Python file's comments (tokenize: a marker
quoted in a string does not count) and wants, after the codes, some words:

    except Exception:  # noqa: BLE001 - any failure fails the adapter, never the worker
    x = f(y)  # type: ignore[arg-type]  # the stubs type y as str; bytes work too
"""

from __future__ import annotations

import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".venv", ".git", "build", "node_modules", "__pycache__"}
GENERATED = re.compile(r"_pb2(_grpc)?\.pyi?$")  # grpcio-tools' output (scripts/gen_protos.py)

NOQA = re.compile(r"#\s*noqa\b(?P<after>.*)", re.IGNORECASE)
NOQA_CODES = re.compile(r":\s*[A-Z]+[0-9]+(?:\s*,\s*[A-Z]+[0-9]+)*(?P<reason>.*)")
IGNORE = re.compile(r"#\s*type:\s*ignore\b(?P<after>.*)")
IGNORE_CODES = re.compile(r"\[[a-z0-9-]+(?:\s*,\s*[a-z0-9-]+)*\](?P<reason>.*)")


def python_files(root: Path = ROOT) -> Iterator[Path]:
    for path in sorted(root.iterdir()):
        if path.name in SKIP_DIRS or path.name.startswith("."):
            continue
        if path.is_dir():
            yield from python_files(path)
        elif path.suffix in (".py", ".pyi") and not GENERATED.search(path.name):
            yield path


def _has_reason(text: str) -> bool:
    return re.search(r"[A-Za-z]{2,}", text) is not None


def bare_markers(source: str) -> list[tuple[int, str]]:
    """(line, comment) of each marker in ``source`` without its codes or its reason."""
    found = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        for marker, codes in ((NOQA, NOQA_CODES), (IGNORE, IGNORE_CODES)):
            hit = marker.search(token.string)
            if hit is None:
                continue
            named = codes.match(hit.group("after"))
            if named is None or not _has_reason(named.group("reason")):
                found.append((token.start[0], token.string))
    return found


def test_the_check_catches_bare_and_reasonless_markers() -> None:
    source = (
        "a = 1  # noqa\n"
        "b = 2  # noqa: E501\n"
        "c = 3  # type: ignore\n"
        "d = 4  # type: ignore[arg-type]\n"
        "e = 5  # noqa: E501 -- a URL\n"
        "f = 6  # type: ignore[arg-type]  # the stubs say str\n"
        "g = '# noqa'\n"
    )
    assert [line for line, _ in bare_markers(source)] == [1, 2, 3, 4]


def test_every_marker_names_its_codes_and_says_why() -> None:
    bare = [
        f"{path.relative_to(ROOT)}:{line}: {comment}"
        for path in python_files()
        for line, comment in bare_markers(path.read_text(encoding="utf-8"))
    ]
    assert not bare, f"{len(bare)} markers without codes or a reason:\n" + "\n".join(bare)
