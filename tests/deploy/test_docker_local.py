"""`make test-compose` in a clone whose docker/local/ is empty (git ignores it; the preparation
filled only the first clone's): scripts/docker_test_compose.sh fills it from this machine, or stops
before any build naming the preparation step, instead of failing deep in the image build with a
certificate error. The real script runs in a temporary checkout; ``PY`` stands in for pytest
(``echo``), so reaching it shows the check passed. No Docker engine is needed: the base image is
given, so the script asks none."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LOCAL_BASE = "lorastream/python:3.11-bookworm"  # what scripts/docker_host_prepare.sh builds
WHEEL = "torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl"


def _checkout(tmp_path: Path) -> Path:
    """A checkout of the scripts, with docker/ but no docker/local/ (a fresh clone)."""
    root = tmp_path / "clone"
    (root / "scripts").mkdir(parents=True)
    (root / "docker").mkdir()
    for script in ("docker_test_compose.sh", "docker_local.sh"):
        shutil.copy(REPO / "scripts" / script, root / "scripts" / script)
    return root


def _run(root: Path, tmp_path: Path, *, host_ca: bool, base: str, wheel: bool,
         torch_index: str | None = None) -> subprocess.CompletedProcess[str]:
    ca = tmp_path / "host-ca.crt"
    if host_ca:
        ca.write_text("-----BEGIN CERTIFICATE-----\nproxy\n-----END CERTIFICATE-----\n")
    wheels = tmp_path / "find-links"
    wheels.mkdir(exist_ok=True)
    if wheel:
        (wheels / WHEEL).write_bytes(b"not really a wheel")
    env = {
        "PATH": os.environ["PATH"], "HOME": str(tmp_path), "PY": "echo",
        "LORASTREAM_HOST_CA_BUNDLE": str(ca), "LORASTREAM_WHEEL_DIRS": str(wheels),
        "LORASTREAM_PYTHON_IMAGE": base,
    }
    if torch_index is not None:
        env["LORASTREAM_TORCH_INDEX_URL"] = torch_index
    return subprocess.run(["bash", str(root / "scripts" / "docker_test_compose.sh")], env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("host_ca", "base", "wheel", "missing"), [
    (False, "python:3.11-slim", False, "ca-certificates.crt is missing"),
    (True, LOCAL_BASE, False, "wheels has no torch wheel"),
    (False, LOCAL_BASE, True, "ca-certificates.crt is missing"),
])
def test_a_clone_missing_what_the_build_needs_stops_at_once_naming_the_preparation_step(
    tmp_path: Path, host_ca: bool, base: str, wheel: bool, missing: str
) -> None:
    root = _checkout(tmp_path)
    ran = _run(root, tmp_path, host_ca=host_ca, base=base, wheel=wheel)
    assert ran.returncode == 1, ran
    assert missing in ran.stderr
    assert "scripts/docker_host_prepare.sh (step 5, docker/local)" in ran.stderr
    assert "tests/compose_live" not in ran.stdout  # pytest (and so any build) never started


@pytest.mark.parametrize(("base", "wheel", "torch_index", "index_shown"), [
    (LOCAL_BASE, True, None, "''"),  # the wheelhouse has torch: no index
    ("python:3.11-slim", False, None, "'https://download.pytorch.org/whl/cpu'"),
    (LOCAL_BASE, False, "http://mirror.internal/torch", "'http://mirror.internal/torch'"),
])
def test_a_fresh_clone_fills_docker_local_from_this_machine_then_runs(
    tmp_path: Path, base: str, wheel: bool, torch_index: str | None, index_shown: str
) -> None:
    root = _checkout(tmp_path)
    ran = _run(root, tmp_path, host_ca=True, base=base, wheel=wheel, torch_index=torch_index)
    assert ran.returncode == 0, ran
    assert f"torch index {index_shown}" in ran.stdout
    assert "tests/compose_live" in ran.stdout  # pytest's turn came
    local = root / "docker" / "local"
    assert (local / "ca-certificates.crt").read_bytes() == (tmp_path / "host-ca.crt").read_bytes()
    assert [p.name for p in (local / "wheels").iterdir()] == ([WHEEL] if wheel else [])
