"""The benchmark page's generator: docs/BENCHMARKS.md (tables, goal verdicts, plots) from the
result JSONs that `lorastream bench <workload>` writes.

A development tool: it ships in no wheel and its dependency (matplotlib) is in the dev lock only.
Run it from the repository root: `python -m benchpage` (`make bench-report`).
"""
