"""A guard against idle cores: a saturated stack on the default model must keep its CPU busy.

Through the stack as ``lorastream up`` starts it, 16 concurrent streams: the machine may be idle
at most a third of the window (other processes on a shared box only lower the idle share, so
noise cannot fail this), and the worker's two busiest threads -- the engine's and its OpenMP
worker, on a 2-core box -- must both compute: a request thread's thread count once left the
second at 0 CPU-seconds while the first ran every step alone, which no amount of noise hides."""

from __future__ import annotations

import os

import pytest

from lorastream.bench.saturate import IDLE_LIMIT, SaturateConfig, run_served


@pytest.mark.slow
def test_a_saturated_worker_leaves_at_most_a_third_of_the_cpu_idle() -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: no second compute thread to lose")
    config = SaturateConfig(requests=64, concurrency=16, adapters=(0,), engine=False)
    served = run_served(config, {})
    assert served["errors"] == 0, served["first_error"]
    assert served["machine_idle_share"] <= IDLE_LIMIT, (
        f"the machine was {served['machine_idle_share']:.0%} idle while the stack was saturated: "
        f"{served}")
    first, second = served["busiest_threads_cpu_s"][:2]
    assert second >= first / 3, (
        f"the worker computed on one thread ({first} CPU-s) while its next busiest used {second}: "
        f"the engine lost its intra-op threads (lorastream/worker/device/device.py)")
