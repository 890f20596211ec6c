"""The machine and command recorded in every benchmark result."""

from __future__ import annotations

import json
import sys

import pytest

from lorastream.bench.machine import (
    command_line,
    cpu_model,
    machine_info,
    memory_read_bandwidth_gbs,
)
from lorastream.worker.device.cpu.native_env import SPIN_COUNT, openmp_spin_count

KEYS = {"cpu", "logical_cores", "usable_cores", "memory_gib", "os", "python", "torch",
        "torch_threads", "openmp_spin_count", "cuda_device", "commit", "dirty", "date_utc"}


def test_machine_info_has_every_field_and_is_json() -> None:
    info = machine_info(bandwidth=False)
    assert set(info) == KEYS
    assert isinstance(info["cpu"], str) and info["cpu"]
    assert isinstance(info["logical_cores"], int) and info["logical_cores"] >= 1
    assert isinstance(info["memory_gib"], float) and info["memory_gib"] > 0
    assert str(info["date_utc"]).endswith("+00:00")
    json.dumps(info)


@pytest.mark.parametrize(
    ("env", "recorded"),
    [
        ({}, SPIN_COUNT),  # what worker serve and bench engine set
        ({"GOMP_SPINCOUNT": "123"}, "123"),  # the user's, which they keep
        ({"OMP_WAIT_POLICY": "active"}, None),  # the user's policy alone: libgomp's own count
        ({"GOMP_SPINCOUNT": "7", "OMP_WAIT_POLICY": "passive"}, "7"),
    ],
)
def test_the_openmp_spin_count_recorded_is_the_one_the_computing_processes_use(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], recorded: str | None
) -> None:
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert openmp_spin_count() == recorded


@pytest.mark.parametrize(
    ("cpuinfo", "shown"),
    [
        ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
         "model name\t: AMD EPYC\nstepping\t: 1\n\nprocessor\t: 1\nmodel name\t: other\n",
         "AMD EPYC (family 26, model 2, stepping 1)"),
        ("processor\t: 0\nmodel name\t: Some CPU\n", "Some CPU"),  # no ids given
    ],
)
def test_the_cpu_is_named_with_its_family_and_model(cpuinfo: str, shown: str) -> None:
    assert cpu_model(cpuinfo) == shown


def test_a_cpuinfo_without_a_model_name_is_refused() -> None:
    with pytest.raises(ValueError):
        cpu_model("processor\t: 0\nBogoMIPS\t: 50.00\n")


def test_memory_bandwidth_is_measured_in_gb_per_second() -> None:
    assert 0.1 < memory_read_bandwidth_gbs(nbytes=16 << 20, repeats=2) < 10_000
    assert "memory_bandwidth_gbs" in machine_info()


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (["/venv/bin/lorastream", "bench", "transfer", "--chunk-sizes", "64K,1M"],
         "lorastream bench transfer --chunk-sizes 64K,1M"),
        (["/repo/lorastream/cli/main.py", "bench", "engine", "--model", "a b"],
         "lorastream bench engine --model 'a b'"),
        (["/venv/bin/pytest", "-q"], "pytest -q"),
    ],
)
def test_command_line_is_what_the_user_typed(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], shown: str
) -> None:
    monkeypatch.setattr(sys, "argv", argv)
    assert command_line() == shown
