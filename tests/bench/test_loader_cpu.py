"""``LoaderCpu``: the store's CPU time plus that of the worker's child processes, not the
worker's own."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from lorastream.bench.loader_cpu import LoaderCpu, cpu_seconds

BURN = "import time\nend = time.process_time() + {seconds}\nwhile time.process_time() < end: pass\n"


def _burner(seconds: float, then_sleep: bool = True) -> subprocess.Popen[bytes]:
    code = BURN.format(seconds=seconds) + ("time.sleep(60)\n" if then_sleep else "")
    return subprocess.Popen([sys.executable, "-c", code])


def _wait_cpu(process: psutil.Process, at_least: float) -> None:
    deadline = time.monotonic() + 30
    while cpu_seconds(process) < at_least and time.monotonic() < deadline:
        time.sleep(0.05)


def test_loader_cpu_counts_the_store_and_the_workers_children_not_the_worker() -> None:
    store = _burner(0.3)
    # the "worker" burns 0.6 s itself and starts a child (its fetch process) that burns 0.2 s
    worker_code = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen("
        f"[sys.executable, '-c', {BURN.format(seconds=0.2) + 'time.sleep(60)'!r}])\n"
        + BURN.format(seconds=0.6) + "time.sleep(60)\n"
    )
    worker = subprocess.Popen([sys.executable, "-c", worker_code])
    try:
        loaders = LoaderCpu(store.pid, worker.pid)
        worker_process = psutil.Process(worker.pid)
        _wait_cpu(psutil.Process(store.pid), 0.3)
        _wait_cpu(worker_process, 0.6)
        deadline = time.monotonic() + 30
        while not worker_process.children() and time.monotonic() < deadline:
            time.sleep(0.05)
        _wait_cpu(worker_process.children()[0], 0.2)
        seconds = loaders.seconds()
        # 0.3 + 0.2 burnt, plus the interpreters' start-up; the worker's own 0.6 s not counted
        assert 0.5 <= seconds < 0.5 + 0.5
    finally:
        for process in (store, worker):
            for child in psutil.Process(process.pid).children(recursive=True):
                child.kill()
            process.kill()
            process.wait()


def test_a_process_that_is_gone_counts_nothing() -> None:
    gone = _burner(0.0, then_sleep=False)
    process = psutil.Process(gone.pid)
    gone.wait()
    assert cpu_seconds(process) == 0.0  # reaped: psutil's NoSuchProcess, not an error
