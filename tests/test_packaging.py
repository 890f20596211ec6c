"""The installed package: one import root, ``lorastream``, with every folder the repository maps."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# repository folder -> the subpackage it installs as (setup.py's PACKAGE_DIRS)
MAPPED = {
    "lorastream": "lorastream",
    "services/adapter_store": "lorastream/store",
    "services/gpu_worker": "lorastream/worker",
    "gateway": "lorastream/gateway",
    "kernels": "lorastream/kernels",
}


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    # Built from a copy: setuptools writes build/ and *.egg-info beside the sources.
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, src / name)
    for folder in MAPPED:
        shutil.copytree(REPO / folder, src / folder,
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


@pytest.mark.parametrize("folder", sorted(MAPPED))
def test_every_module_of_a_mapped_folder_is_in_the_wheel(
    wheel_names: set[str], folder: str
) -> None:
    root = REPO / folder
    expected = {
        f"{MAPPED[folder]}/{path.relative_to(root).as_posix()}"
        for path in root.rglob("*.py")
        if (path.parent / "__init__.py").is_file() and ".venv" not in path.parts
    }
    assert expected, folder
    assert expected - wheel_names == set()


def test_the_sample_adapters_ship_in_the_wheel(wheel_names: set[str]) -> None:
    assert "lorastream/samples/adapters/french/adapter_model.safetensors" in wheel_names
