"""``lorastream bench``: a benchmark stopped with SIGTERM stops what it spawned."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigterm_stops_the_store_a_serving_benchmark_spawned(tmp_path: Path) -> None:
    """``bench serve`` spawns its store first; SIGTERM to the benchmark while it starts the
    rest must stop that store too (before, the store outlived its parent)."""
    bench = subprocess.Popen(
        [sys.executable, "-m", "lorastream.cli.main", "bench", "serve", "--parts", "link",
         "--link-rounds", "1", "--adapters", "2", "--slots", "1", "--rank", "4"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    children: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not children and time.monotonic() < deadline and bench.poll() is None:
            children = _children(bench.pid)
            time.sleep(0.1)
        assert children, "the benchmark spawned no child process within 120 s"
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(90) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in children if _alive(pid)], "a child outlived the benchmark"
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        for pid in children:  # what a failed run left behind
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_bench_engine_refuses_an_unknown_vocab_kind_naming_the_known_ones() -> None:
    from typer.testing import CliRunner

    from lorastream.cli.main import app

    result = CliRunner().invoke(app, ["bench", "engine", "--vocab", "embed-lora,lm-head"],
                                env={"COLUMNS": "400"})
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert "unknown kind lm-head; known: embed-lora, head-lora, saved-embed, saved-head" in (
        message)
