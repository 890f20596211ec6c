"""``python -m benchpage``: write the benchmark page from the result JSONs."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from benchpage.report import write_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchpage",
        description="Write the benchmark page (tables, goal verdicts, plots, commands, machine) "
        "from the result JSONs; a missing result is shown as not run.")
    parser.add_argument("--results", type=Path, default=Path("docs/benchmarks/results"),
                        help="directory of the result .json files (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("docs/BENCHMARKS.md"),
                        help="page to write (default: %(default)s)")
    parser.add_argument("--plots", type=Path, default=None,
                        help="directory for the PNG plots (default: RESULTS/../plots)")
    parser.add_argument("--log-level", default="WARNING", help="logging level")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if not args.results.is_dir():
        print(f"error: --results {args.results}: no such directory", file=sys.stderr)
        return 2
    print(f"wrote {write_report(args.results, args.out, args.plots)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
