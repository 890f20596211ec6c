"""The GPU check's pieces that a CPU machine can prove in seconds (scripts/gpu_dry_run.sh, which
CI runs after the suite, proves the rest: the wheelhouse installed over a stand-in of the GPU
image, every import, tests/gpu skipping for want of CUDA).

- every third-party package the GPU path imports is in the GPU image or the wheelhouse;
- the wheelhouse's pins are the locked versions (the GPU runs what CI tested);
- scripts/gpu_check.sh refuses a machine without CUDA, and says so;
- the serving benchmark's code path runs end to end on a tiny random model on the CPU, dense and
  mixture-of-experts (its figures are never a GPU figure), and its command refuses to run
  without CUDA, for every shape the GPU check runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from importlib.metadata import packages_distributions
from pathlib import Path
from types import ModuleType

import pytest
import torch

from lorastream.bench.gpu_serving import main as gpu_serving_main
from lorastream.bench.gpu_serving import run_gpu_serving_bench

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(path: Path) -> dict[str, str]:
    """name -> version (None when unpinned) of a requirements file, comments and -r lines out."""
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            name, _, version = line.partition("==")
            pins[_normal(name)] = version
    return pins


def test_every_third_party_import_of_the_gpu_path_is_in_the_image_or_the_wheelhouse() -> None:
    _, external = _script("gpu_imports").closure(_script("gpu_imports").roots())
    provided = {*_pins(SCRIPTS / "gpu_image_packages.txt"),
                *_pins(SCRIPTS / "gpu_requirements.txt")}
    distributions = packages_distributions()
    missing = {
        top: sorted(users)[:3] for top, users in external.items()
        if not {_normal(d) for d in distributions.get(top, [top])} & provided
    }
    assert not missing, f"imported on the GPU path, in neither package list: {missing}"
    assert {"torch", "triton", "transformers", "peft", "grpc"} <= set(external)


def test_the_wheelhouse_pins_are_the_locked_versions() -> None:
    locked = {**_pins(ROOT / "requirements.lock"), **_pins(ROOT / "requirements-dev.lock")}
    pins = _pins(SCRIPTS / "gpu_requirements.txt")
    assert all(pins.values()), "every wheelhouse requirement is pinned (pip install --no-deps)"
    differ = {n: (v, locked.get(n)) for n, v in pins.items() if locked.get(n) != v}
    assert not differ, f"wheelhouse pin != lock (pin, lock): {differ}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_the_gpu_check_refuses_a_machine_without_cuda(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh"), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no CUDA device here" in (tmp_path / "summary.txt").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("args", [
    [],  # the Llama-3.1-8B shapes
    ["--shape", "qwen3-30b-a3b", "--streams", "8", "--cold-adapters", "6"],
])
def test_the_gpu_serving_command_refuses_to_run_without_cuda(
    args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert gpu_serving_main([*args, "--output", str(tmp_path / "out.json")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize(("shape", "adapters"), [
    ("tiny", "all-linear"),
    ("tiny-moe", "q/k/v/o + every expert's gate_up and down (target_parameters)"),
])
def test_the_gpu_serving_benchmark_runs_its_phases_on_a_tiny_cpu_model(
    shape: str, adapters: str
) -> None:
    result = run_gpu_serving_bench(shape=shape, streams=3, rank=8, new_tokens=6,
                                   prompt_tokens=8, cold_adapters=5, repeats=1,
                                   lora_backend="torch", device="cpu")
    json.dumps(result)  # what the command writes
    assert result["device"] == "cpu" and result["resident_on_device"] == 3
    assert result["moe"] is (shape == "tiny-moe") and result["adapters"].startswith(adapters)
    assert (result["streams"], result["cold_adapters"]) == (3, 5)
    assert (result["counts_note"] is not None) is result["moe"]
    assert result["adapter_mb"] > 0 and result["slot_mb"] > 0
    assert result["host_cache_mb"] >= 8 * result["adapter_mb"]  # every adapter fits in it
    itl = result["itl"]
    assert itl["none"]["slot_loads"] == 0 and itl["overlap_off_none"]["slot_loads"] == 0
    # every stream decoded while cold adapters were copied into slots, on both engines
    assert itl["overlap_on"]["slot_loads"] >= 1 and itl["overlap_off"]["slot_loads"] >= 1
    assert itl["overlap_on"]["gaps"] > 0 and itl["overlap_on"]["itl_p99_ms"] > 0
    ttft = result["ttft"]
    assert ttft["cold_requests"] >= 1 and ttft["cold_ms"] > 0 and ttft["h2d_ms"] > 0
    assert result["decode"]["multi_tok_s"] > 0 and result["decode"]["base_tok_s"] > 0
