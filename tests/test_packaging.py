"""The installed package: one import root, ``lorastream``, with every module under the folder of
the same name; its dependencies: a runtime lock apart from the dev lock, both within pyproject's
ranges."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from typer.testing import CliRunner

from lorastream.cli.main import app

REPO = Path(__file__).resolve().parents[1]
# The subpackages that hold the services and kernels: each folder's path is its import name.
PACKAGES = ["lorastream", "lorastream/store", "lorastream/worker", "lorastream/gateway",
            "lorastream/kernels"]


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    # Built from a copy: setuptools writes build/ and *.egg-info beside the sources.
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "lorastream", src / "lorastream",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(out), str(src)],
        check=True, capture_output=True, timeout=240,
    )
    (wheel,) = out.glob("lorastream-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


def test_the_wheel_installs_only_the_lorastream_root(wheel_names: set[str]) -> None:
    tops = {name.split("/")[0] for name in wheel_names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"lorastream"}


@pytest.mark.parametrize("folder", PACKAGES)
def test_every_module_of_a_package_is_in_the_wheel(wheel_names: set[str], folder: str) -> None:
    root = REPO / folder
    expected = {
        path.relative_to(REPO).as_posix()
        for path in root.rglob("*.py")
        if (path.parent / "__init__.py").is_file() and ".venv" not in path.parts
    }
    assert expected, folder
    assert expected - wheel_names == set()


def test_the_sample_adapters_ship_in_the_wheel(wheel_names: set[str]) -> None:
    assert "lorastream/samples/adapters/french/adapter_model.safetensors" in wheel_names


def test_the_cpu_attention_kernel_source_ships_in_the_wheel(wheel_names: set[str]) -> None:
    """lorastream/kernels/cpu/attention.py compiles it where the package is installed."""
    assert "lorastream/kernels/cpu/csrc/decode_attention.cpp" in wheel_names


# -- the locks: runtime apart from the test and benchmark tools ------------------------------------
LOCKS = sorted(REPO.glob("requirements*.lock"))
# Tools that `make up` and the images must not install (the dev and bench extras, the gpu extra).
# (accelerate and psutil are runtime: transformers' GGUF loader needs accelerate, which needs
# psutil.)
NOT_RUNTIME = ["pytest", "pytest-asyncio", "pytest-timeout", "moto", "flask", "cfn-lint", "peft",
               "openai", "matplotlib", "grpcio-tools", "triton"]


def _pins(lock: Path) -> dict[str, str]:
    """canonical name -> version of the ``name==version`` lines of a lock."""
    pins = {}
    for line in lock.read_text(encoding="utf-8").splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version.strip()
    return pins


def _project() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def test_there_are_two_locks_and_the_dev_lock_builds_on_the_runtime_lock() -> None:
    assert [lock.name for lock in LOCKS] == ["requirements-dev.lock", "requirements.lock"]
    dev_lines = (REPO / "requirements-dev.lock").read_text(encoding="utf-8").splitlines()
    assert "-r requirements.lock" in dev_lines
    runtime, dev = _pins(REPO / "requirements.lock"), _pins(REPO / "requirements-dev.lock")
    assert runtime.keys().isdisjoint(dev)


@pytest.mark.parametrize("tool", NOT_RUNTIME)
def test_the_runtime_lock_holds_no_test_benchmark_or_gpu_tool(tool: str) -> None:
    assert tool not in _pins(REPO / "requirements.lock")
    # triton too: the suite runs the Triton kernels in Triton's interpreter on the CPU
    assert tool in _pins(REPO / "requirements-dev.lock")


@pytest.mark.parametrize("group", ["dependencies", "dev", "bench", "gpu"])
def test_pyproject_ranges_admit_the_locked_versions(group: str) -> None:
    project = _project()
    requirements = project[group] if group == "dependencies" else (
        project["optional-dependencies"][group]
    )
    locked = _pins(REPO / "requirements.lock")
    if group != "dependencies":
        locked |= _pins(REPO / "requirements-dev.lock")
    for requirement in map(Requirement, requirements):
        name = canonicalize_name(requirement.name)
        assert name in locked, f"{requirement} ({group}) is in no lock"
        assert requirement.specifier.contains(locked[name], prereleases=True), (
            f"{requirement} ({group}) does not admit the locked {name}=={locked[name]}"
        )


def test_the_locks_are_the_closure_of_pyproject_as_installed() -> None:
    spec = importlib.util.spec_from_file_location("write_locks", REPO / "scripts/write_locks.py")
    assert spec is not None and spec.loader is not None
    write_locks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(write_locks)
    runtime, dev = write_locks.locks()
    assert (REPO / "requirements.lock").read_text(encoding="utf-8") == runtime, (
        "requirements.lock is stale: run scripts/write_locks.py"
    )
    assert (REPO / "requirements-dev.lock").read_text(encoding="utf-8") == dev, (
        "requirements-dev.lock is stale: run scripts/write_locks.py"
    )


@pytest.mark.parametrize(
    ("target", "installs"),
    [
        ("up", ["requirements.lock"]),
        ("test", ["requirements.lock", "requirements-dev.lock"]),
        ("test-slow", ["requirements.lock", "requirements-dev.lock"]),
        ("bench", ["requirements.lock", "requirements-dev.lock"]),
    ],
)
def test_each_make_target_installs_the_locks_it_needs(
    target: str, installs: list[str], tmp_path: Path
) -> None:
    plan = subprocess.run(
        ["make", "-n", target, f"VENV={tmp_path / 'venv'}"], cwd=REPO, capture_output=True,
        text=True, check=True, timeout=60,
    ).stdout
    installed = sorted(set(re.findall(r"pip install .*-r (\S+)", plan)))
    assert installed == sorted(installs), plan


@pytest.mark.parametrize("lock", [lock.name for lock in LOCKS])
def test_every_lock_keys_the_ci_venv_and_the_install_stamp(lock: str) -> None:
    ci_key = next(line for line in (REPO / ".ci/run").read_text().splitlines()
                  if line.startswith("key="))
    assert lock in ci_key
    dev_stamp = next(line for line in (REPO / "Makefile").read_text().splitlines()
                     if line.startswith("DEV_STAMP :="))
    assert lock in dev_stamp and "$(CURDIR)" in dev_stamp


@pytest.mark.parametrize("missing", ["psutil", "peft"])
def test_bench_without_the_bench_extra_says_how_to_install_it(
    missing: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, missing, None)  # as if not installed: find_spec -> None
    result = CliRunner().invoke(app, ["bench", "registry", "--output", str(tmp_path / "r.json")])
    assert result.exit_code == 2
    assert f"missing: {missing}" in result.output and "requirements-dev.lock" in result.output
    assert "Traceback" not in result.output
