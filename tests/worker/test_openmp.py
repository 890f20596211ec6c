"""`worker serve` and `bench engine` shorten OpenMP's spin-waits before torch loads, unless the
user chose a wait policy; once torch is loaded it is too late and nothing is changed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lorastream.core.openmp import SPIN_COUNT, waits_actively

PROBE = (
    "import os, sys; from lorastream.core.openmp import tune_openmp_waits; {before}"
    "tune_openmp_waits(); print(os.environ.get('GOMP_SPINCOUNT'))"
)


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
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(before=before)],
        env={**clean, **env}, capture_output=True, text=True, check=True,
    ).stdout.strip()
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
