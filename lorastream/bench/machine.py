"""The machine a benchmark ran on, and the command that ran it: recorded in every result JSON so
that the generated benchmark page states where each figure comes from."""

from __future__ import annotations

import datetime as dt
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import psutil

from lorastream.worker.device.cpu.native_env import openmp_spin_count

_REPO = Path(__file__).resolve().parents[2]
_BANDWIDTH_BYTES = 256 << 20  # read by torch.sum, far larger than any CPU cache


def machine_info(bandwidth: bool = True) -> dict[str, object]:
    """CPU, cores, memory, software versions, lorastream commit, date and memory read bandwidth.

    ``bandwidth=False`` skips the bandwidth measurement (about 0.5 s and 256 MB of memory)."""
    import torch  # here, not at the top: processes that only record the command stay light

    info: dict[str, object] = {
        "cpu": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": round(psutil.virtual_memory().total / (1 << 30), 1),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "openmp_spin_count": openmp_spin_count(),
        **_git_commit(),
        "date_utc": dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat(),
    }
    if bandwidth:
        info["memory_bandwidth_gbs"] = round(memory_read_bandwidth_gbs(), 1)
    return info


def memory_read_bandwidth_gbs(nbytes: int = _BANDWIDTH_BYTES, repeats: int = 5) -> float:
    """Best of ``repeats`` ``torch.sum`` over a float32 tensor of ``nbytes`` (GB/s, 1e9 bytes)."""
    import torch

    data = torch.ones(nbytes // 4, dtype=torch.float32)  # [n], written once so it is paged in
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.sum(data)
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def command_line() -> str:
    """The command being run, as a user would type it: ``lorastream bench ...`` under the console
    script or ``python -m lorastream.cli.main``, else the Python invocation as is."""
    prog = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"
    module_run = sys.argv[0].endswith(("lorastream/cli/main.py", "lorastream.cli.main"))
    if prog == "lorastream" or module_run:
        return "lorastream " + shlex.join(sys.argv[1:])
    return shlex.join([prog, *sys.argv[1:]])


def _cpu_model() -> str:
    try:
        return cpu_model(Path("/proc/cpuinfo").read_text())
    except (OSError, ValueError):
        return platform.processor() or platform.machine() or "unknown"


def cpu_model(cpuinfo: str) -> str:
    """The first processor's model name from ``/proc/cpuinfo`` text, with its family, model and
    stepping where given: a VM's model name can be as bare as "AMD EPYC", which named two
    machines of this project whose decode speed differed 4x (docs/notes/serve-goals.md)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the end of the first processor's block
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name")
    if not name:
        raise ValueError("no model name in /proc/cpuinfo")
    labels = (("cpu family", "family"), ("model", "model"), ("stepping", "stepping"))
    ids = [f"{label} {fields[key]}" for key, label in labels if key in fields]
    return f"{name} ({', '.join(ids)})" if ids else name


def _git_commit() -> dict[str, object]:
    """``{"commit": short sha, "dirty": bool}``, or nulls when this is not a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(_REPO), *args], capture_output=True, text=True, timeout=10,
            check=True,
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        # The benchmarks' own outputs (results, plots, the page) do not make the code dirty.
        dirty = bool(git("status", "--porcelain", "--untracked-files=no", "--", ".",
                         ":(exclude)docs/benchmarks", ":(exclude)docs/BENCHMARKS.md"))
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": dirty}
