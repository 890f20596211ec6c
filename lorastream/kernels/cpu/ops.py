"""The C++ CPU ops (``csrc/*.cpp``): built once, loaded, or the reason they are not.

``torch.utils.cpp_extension`` compiles them into one extension (a C++ compiler and ninja, ~15 s)
under ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``), in a directory named by
a digest of the sources, flags and torch version; later loads take well under a second. They
register ``torch.ops.lorastream.*``:

- ``decode_scores`` / ``decode_values``: decode attention over the paged KV cache
  (``cpu_attention.py``);
- ``lora_rows``, ``expert_lora_rows``: the LoRA delta of slot-major steps and of a MoE layer's
  expert assignments at decode (``cpu_lora.py``);
- ``expert_segments_mm``: a MoE layer's routed experts at decode (``cpu/moe.py``);
- ``rotate_rows``, ``rotate_scale_rows``: int8-dynamic's input rotation, the second with each
  row scaled to int8's range (``cpu_rotation.py``);
- ``int8_weight_mm``: int8 weight-only products with fp32 activations (``cpu_int8.py``);
- ``rms_norm``, ``rotary``: RMSNorm of hidden states and the rotary embedding of q and k
  (``cpu_norm_rope.py``);
- ``multiply_add_peak``: the cores' multiply-add rate per kind of product, for the benchmarks'
  roofline (``cpu_peak.py``).

:func:`load` returns why they could not be built, and the worker then keeps torch's paths
(``--cpu-kernels``, docs/worker.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))  # included by the sources
EXTENSION_NAME = "lorastream_cpu_ops"

_lock = threading.Lock()
_state: dict[str, str | None] = {}  # "error": None once loaded, the reason if it failed


def _flags() -> list[str]:
    """-O3 and OpenMP (torch's own runtime: libgomp is already loaded under the same soname, so
    at::parallel_for runs on torch's intra-op threads); AVX2/FMA where this CPU has them (the
    flags are part of the build's hash: another CPU builds its own)."""
    flags = ["-O3", "-fopenmp"]
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma"]
    return flags


def _build_directory(flags: list[str]) -> tuple[str, Path, list[Path]]:
    """The extension's name, its build directory and the sources to build there, all named by a
    digest of the sources and headers, the flags and torch's version: two installs of different
    lorastream versions (or a CI clone beside a checkout) never rebuild over each other, and two
    of the same find one build. Sources and headers are copied in, so the build does not depend
    on where the package lies (ninja rebuilds when a source's path changes)."""
    texts = {path.name: path.read_bytes() for path in [*SOURCES, *HEADERS]}
    digest = hashlib.sha256(" ".join([torch.__version__, *flags]).encode())
    for file_name, text in texts.items():
        digest.update(file_name.encode() + b"\0" + text)
    name = f"{EXTENSION_NAME}_{digest.hexdigest()[:16]}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    build = Path(root) / name
    (build / "src").mkdir(parents=True, exist_ok=True)
    copies = []
    for file_name, text in texts.items():
        copy = build / "src" / file_name
        if not copy.exists() or copy.read_bytes() != text:
            partial = copy.with_suffix(f".{os.getpid()}.part")
            partial.write_bytes(text)
            partial.replace(copy)  # atomic: a concurrent build reads one whole file or the other
        if copy.suffix == ".cpp":
            copies.append(copy)
    return name, build, copies


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """torch runs ``ninja`` from PATH; the ``ninja`` package's binary (a runtime dependency) sits
    in the venv's bin, which is not on PATH when the venv's python is run directly. PATH gets it
    for the build only: what else the process runs (and prints) sees its own PATH."""
    try:
        import ninja
    except ImportError:  # then a system ninja, if any
        yield
        return
    before = os.environ.get("PATH")
    if shutil.which("ninja") is None:
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, *filter(None, [before])])
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before


def load() -> str | None:
    """Build (first time) and load the ops; None when they are there, else the reason not."""
    with _lock:
        if "error" in _state:
            return _state["error"]
        started = time.perf_counter()
        try:
            from torch.utils import cpp_extension

            flags = _flags()
            name, build, sources = _build_directory(flags)
            with _ninja_on_path():
                cpp_extension.load(
                    name=name, sources=[str(p) for p in sources], extra_cflags=flags,
                    extra_ldflags=["-fopenmp"], build_directory=str(build),
                    is_python_module=False, verbose=False,
                )
            ops = ("decode_scores", "decode_values", "lora_rows", "expert_lora_rows",
                   "expert_segments_mm", "rotate_rows", "rotate_scale_rows", "int8_weight_mm",
                   "rms_norm", "rotary", "multiply_add_peak")
            for op in ops:  # registered, or an error
                getattr(torch.ops.lorastream, op)
        except Exception as err:  # a missing compiler or ninja, a failed build: keep torch's path
            reason = " ".join(f"{type(err).__name__}: {err}".split())[:500]
            _state["error"] = reason
            return reason
        _state["error"] = None
        log.info("CPU kernels (decode attention, LoRA rows, rotation, int8 product, RMSNorm, "
                 "rotary) ready "
                 "in %.1f s",
                 time.perf_counter() - started)
        return None
