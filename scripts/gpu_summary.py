"""A short summary of a pytest JUnit XML file: counts, every test that failed or errored with
its message, and the skipped tests grouped by their reason (what scripts/gpu_check.sh brings
home, and what the dry run checks).

    python scripts/gpu_summary.py gpu-tests.xml [--out summary.txt]
    python scripts/gpu_summary.py gpu-tests.xml --expect-all-skipped "no CUDA device"

Exit status: 0; 1 if a test failed or errored, or (with --expect-all-skipped) if a test did not
skip with a reason containing the given text.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

OUTCOMES = ("failure", "error", "skipped")


def outcomes(junit: Path) -> list[tuple[str, str, str]]:
    """(test id, outcome: passed | failure | error | skipped, reason) for every test case."""
    rows: list[tuple[str, str, str]] = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, reason = "passed", ""
        for kind in OUTCOMES:
            element = case.find(kind)
            if element is not None:
                outcome = kind
                reason = (element.get("message") or element.text or "").strip()
                break
        rows.append((test, outcome, reason.splitlines()[0] if reason else ""))
    return rows


def summary(rows: list[tuple[str, str, str]]) -> str:
    """Counts; every failure and error on its own line; skips grouped by reason."""
    counts = Counter(outcome for _, outcome, _ in rows)
    lines = [f"{len(rows)} tests: " + ", ".join(
        f"{counts[o]} {o}" for o in ("passed", *OUTCOMES) if counts[o])]
    for kind in ("failure", "error"):
        lines += [f"{kind.upper():8} {test}: {reason[:300]}"
                  for test, outcome, reason in rows if outcome == kind]
    skipped: dict[str, list[str]] = {}
    for test, outcome, reason in rows:
        if outcome == "skipped":
            skipped.setdefault(reason, []).append(test)
    for reason, tests in skipped.items():
        shown = ", ".join(tests[:3]) + (f", ... ({len(tests) - 3} more)" if len(tests) > 3 else "")
        lines.append(f"SKIPPED  {len(tests)} for: {reason[:300]} -- {shown}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", type=Path)
    parser.add_argument("--out", type=Path, help="also write the summary here")
    parser.add_argument("--expect-all-skipped", metavar="REASON",
                        help="fail unless every test skipped with a reason containing REASON")
    args = parser.parse_args(argv)
    rows = outcomes(args.junit)
    text = summary(rows)
    print(text)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")
    if any(outcome in ("failure", "error") for _, outcome, _ in rows):
        return 1
    if args.expect_all_skipped is not None:
        stray = [t for t, o, r in rows if o != "skipped" or args.expect_all_skipped not in r]
        if stray or not rows:
            print(f"expected every test to skip with {args.expect_all_skipped!r}; "
                  f"{len(stray)} did not: {stray[:5]}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
