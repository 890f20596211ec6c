"""`worker serve` and `bench engine` shorten OpenMP's spin-waits and bound oneDNN's caches before
torch loads, unless the user chose; once torch is loaded it is too late and nothing is changed.
With the caches bounded, a projection run on every row count up to a step's budget leaves the
process's memory where it was; at oneDNN's and ideep's defaults it does not."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lorastream.worker.device.cpu.native_env import (
    CACHE_VARIABLES,
    ONEDNN_CACHE_ENTRIES,
    SPIN_COUNT,
    waits_actively,
)

PROBE = (
    "import os, sys; "
    "from lorastream.worker.device.cpu.native_env import tune_openmp_waits; {before}"
    "tune_openmp_waits(); print(os.environ.get('GOMP_SPINCOUNT'))"
)


def _python_output(code: str, unset: tuple[str, ...], env: dict[str, str]) -> str:
    """What a fresh interpreter running ``code`` prints, with ``unset`` removed from this
    process's environment and ``env`` added."""
    clean = {k: v for k, v in os.environ.items() if k not in unset}
    return subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
        check=True,
    ).stdout.strip()


@pytest.mark.parametrize(
    ("env", "before", "expected"),
    [
        ({}, "", SPIN_COUNT),
        ({"GOMP_SPINCOUNT": "123"}, "", "123"),  # the user's value stays
        ({"OMP_WAIT_POLICY": "active"}, "", "None"),  # so does the user's policy
        ({}, "import torch; ", "None"),  # too late: libgomp has read its environment
    ],
)
def test_spin_count_is_set_only_before_torch_and_never_over_the_users_choice(
    env: dict[str, str], before: str, expected: str
) -> None:
    out = _python_output(PROBE.format(before=before), ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"), env)
    assert out == expected


@pytest.mark.parametrize(
    ("policy", "active"), [("ACTIVE", True), ("active", True), ("passive", False), (None, False)]
)
def test_an_active_wait_policy_is_recognised_in_any_case(
    monkeypatch: pytest.MonkeyPatch, policy: str | None, active: bool
) -> None:
    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    assert waits_actively() is active


CACHE_PROBE = (
    "import os, sys; "
    "from lorastream.worker.device.cpu.native_env import tune_native_libraries; {before}"
    "tune_native_libraries(); "
    "print(os.environ.get('ONEDNN_PRIMITIVE_CACHE_CAPACITY'), os.environ.get('LRU_CACHE_CAPACITY'))"
)


@pytest.mark.parametrize(
    ("env", "before", "expected"),
    [
        ({}, "", f"{ONEDNN_CACHE_ENTRIES} {ONEDNN_CACHE_ENTRIES}"),
        ({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "7"}, "", f"7 {ONEDNN_CACHE_ENTRIES}"),
        ({}, "import torch; ", "None None"),  # too late
    ],
)
def test_cache_capacities_are_set_only_before_torch_and_never_over_the_users_choice(
    env: dict[str, str], before: str, expected: str
) -> None:
    out = _python_output(CACHE_PROBE.format(before=before), CACHE_VARIABLES, env)
    assert out == expected


# RSS growth in MB of a process whose prepacked projections (the default model's shapes) run on
# every row count from 1 to 200 after a warm-up on a few of them. glibc's mmap threshold is fixed
# in the probe: otherwise it rises with the largest block freed and the heap's high-water mark
# (a one-off, tens of MB here) adds to what the caches hold.
def _growth_mb(bound: bool) -> float:
    code = f"""
import os
from lorastream.worker.device.cpu.native_env import bound_onednn_caches
if {bound}:
    bound_onednn_caches()
import torch
from lorastream.worker.model.linear import Linear
assert Linear(torch.zeros(8, 8)).prepacked
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
shapes = ((1536, 576), (576, 1536), (576, 576))
layers = [(Linear(torch.randn(n, k) * 0.02), k) for n, k in shapes]
def run(rows):
    for linear, k in layers:
        linear(torch.randn(rows, k))
for rows in (1, 2, 4, 8):
    run(rows)
before = rss_mb()
for rows in range(1, 201):
    run(rows)
print(rss_mb() - before)
"""
    return float(_python_output(code, CACHE_VARIABLES, {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)}))


def test_bounded_caches_keep_memory_flat_over_every_row_count() -> None:
    if not torch_has_onednn():
        pytest.skip("this torch has no oneDNN: the projections do not prepack")
    unbounded, bounded = _growth_mb(False), _growth_mb(True)
    assert bounded < 40, f"RSS grew {bounded:.0f} MB over 200 row counts with bounded caches"
    assert unbounded > 3 * bounded + 40, (
        f"at the libraries' defaults RSS grew {unbounded:.0f} MB, bounded {bounded:.0f} MB: "
        "the probe no longer shows what the bound is for"
    )


def torch_has_onednn() -> bool:
    import torch

    return torch.backends.mkldnn.is_available()


FRAGMENTED_HEAP = """
import sys
import torch
from lorastream.worker.device.cpu.native_env import release_freed_memory
def rss_mb():
    with open('/proc/self/status') as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith('VmRSS'))
big = torch.ones(4 << 20); del big  # 16 MB freed: glibc raises its mmap threshold past 1 MB
parts, kept = [], []
for _ in range(300):  # 300 MB of 1 MB blocks, now from the heap, each pinned in by a small one
    parts.append(torch.ones(1 << 18)); kept.append(torch.ones(1024))
held = rss_mb(); del parts
freed = rss_mb()
if sys.argv[1] == 'release':
    release_freed_memory()
print(held, freed, rss_mb())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's")
@pytest.mark.parametrize("release", [False, True], ids=["kept", "released"])
def test_freed_heap_pages_stay_resident_until_released(release: bool) -> None:
    """What the model build does after its projections copied the loaded weights: 300 MB freed
    between live blocks stay resident until :func:`release_freed_memory` hands them back."""
    out = subprocess.run(
        [sys.executable, "-c", FRAGMENTED_HEAP, "release" if release else "keep"],
        capture_output=True, text=True, check=True,
    ).stdout.split()
    held, freed, after = (int(v) for v in out)
    assert freed > held - 50  # free() alone gives (almost) nothing back
    if release:
        assert after < held - 250
    else:
        assert after > held - 50


RECEIVE_LOOP = """
import os, resource, sys
from lorastream.worker.device.cpu.native_env import keep_freed_buffers
if sys.argv[1] == 'keep':
    assert keep_freed_buffers()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
message = os.urandom(1 << 20)
def receive():  # what a stream client does per message
    buffer = bytearray(message)  # the transport's buffer of one 1 MB message
    data = bytes(buffer)  # the message handed over, then landed and freed
    del buffer
    return len(data)
for _ in range(5):
    receive()
before = faults()
for _ in range(50):
    receive()
print((faults() - before) / 50)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
@pytest.mark.parametrize("keep", [False, True], ids=["defaults", "kept"])
def test_a_receive_loop_faults_in_fresh_pages_unless_freed_buffers_are_kept(keep: bool) -> None:
    """The fetch process's pattern, two 1 MB buffers per message: at glibc's defaults every
    message faults in its pages anew (~3 us each on these VMs); after
    :func:`keep_freed_buffers` the next message reuses them."""
    out = subprocess.run(
        [sys.executable, "-c", RECEIVE_LOOP, "keep" if keep else "defaults"],
        capture_output=True, text=True, check=True,
    ).stdout
    faults_per_message = float(out)
    if keep:
        assert faults_per_message < 8
    else:
        assert faults_per_message > 200  # 256 pages per MB: the fault the setting removes

