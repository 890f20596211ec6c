"""GGUF files as base models: converted once to an fp32 safetensors checkpoint, and what each
GGUF tensor type becomes when it is served.

``--model path/to/model.gguf`` (and the embedded models, embedded.py) go through transformers'
GGUF loader, which dequantizes every tensor: the worker then serves that checkpoint like any
other. How each type is served (:data:`SERVED_AS`):

- ``F32``, ``F16``, ``BF16``: their values, in the worker's ``--dtype`` (fp32 on the CPU).
- ``Q8_0`` (32 int8 values and an fp16 scale per block): dequantized exactly (int8 x fp16 is an
  fp32 value); with ``--quantization int8`` the projections hold 8 bits again (``int8-dynamic``:
  7), requantized per output channel from those values (quant_linear.py): each value moves
  by at most half of its row's int8 step. The blocks of a row carry different scales, so the
  file's own integers do not come back; they are not multiplied directly because no CPU kernel
  torch ships takes per-block scales.
- every other quantized type (``Q4_0``, ``Q4_1``, ``Q4_K``, ``Q5_K``, ``Q6_K`` ...):
  dequantized to fp32; ``--quantization int8`` requantizes those values to 8 bits per channel,
  a second rounding on top of the file's (its step, a row's largest value / 127, is usually
  finer than a 4-6 bit block's).

The converted directory is named by the file's path, size and modification time and by
:data:`CONVERSION_VERSION`: a changed file is converted again, an unchanged one never.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from lorastream.core.errors import InvalidArgument
from lorastream.worker.model import gguf_moe
from lorastream.worker.model.checkpoint_dir import check_checkpoint_dir

log = logging.getLogger(__name__)

CONVERSION_VERSION = "1"  # part of a converted dir's name: bump when the conversion changes
GGUF_SUFFIX = ".gguf"
SOURCE_FILE = "lorastream_gguf_source.json"  # beside a converted checkpoint: the file's types
# What transformers' GGUF loader imports on our behalf (both in requirements.lock): without them
# it fails deep in from_pretrained, so the conversion asks first and says what to install.
GGUF_LOADER_NEEDS = ("gguf", "accelerate")

Converter = Callable[[Path, Path], None]  # (gguf file, empty output dir) -> writes a checkpoint

_EXACT = "its values, in --dtype"
_Q8 = ("dequantized exactly; --quantization int8 holds it in 8 bits again, per output channel "
       "(one more rounding, at most half a step)")
_LOW_BITS = ("dequantized to fp32; --quantization int8 requantizes it to 8 bits per channel "
             "(finer than the file's)")
SERVED_AS = {"F32": _EXACT, "F16": _EXACT, "BF16": _EXACT, "Q8_0": _Q8}


def served_as(tensor_type: str) -> str:
    """How a GGUF tensor type is served (see the module docstring)."""
    return SERVED_AS.get(tensor_type, _LOW_BITS)


def gguf_tensor_types(path: Path) -> Counter[str]:
    """Tensor type name -> how many tensors of ``path`` have it (the header only, memory-mapped);
    InvalidArgument if the file is not a GGUF file gguf can read."""
    require_gguf_loader()
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as err:
        raise InvalidArgument(f"--model {path}: not a GGUF file this worker can read ({err})"
                              ) from err
    return Counter(t.tensor_type.name for t in reader.tensors)


def describe_types(types: Counter[str]) -> str:
    """``"Q8_0 x 154 (dequantized exactly; ...), F32 x 61 (...)"``, most common first."""
    return "; ".join(f"{name} x {count}: {served_as(name)}" for name, count in types.most_common())


def file_version(gguf: Path, identity: str) -> str:
    """12 hex digits that change with ``identity`` (the file's name or path), its size and
    modification time, and :data:`CONVERSION_VERSION`: a converted directory's name suffix."""
    st = gguf.stat()
    key = f"{CONVERSION_VERSION}:{identity}:{st.st_size}:{st.st_mtime_ns}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def converted_gguf_dir(cache_dir: Path, gguf: Path) -> Path:
    """``cache_dir/gguf-<stem>-<12 hex>`` (:func:`file_version` of the resolved path)."""
    return cache_dir / f"gguf-{gguf.stem}-{file_version(gguf, str(gguf.resolve()))}"


def convert_gguf_file(cache_dir: Path, gguf: Path, convert: Converter | None = None) -> Path:
    """``--model model.gguf``: its converted checkpoint under ``cache_dir``, converted first if
    needed (a progress bar per step of transformers' loader; seconds for a small model, minutes
    for billions of parameters). Logs the file's tensor types and how each is served: read from
    the file at its conversion and kept beside the checkpoint (:data:`SOURCE_FILE`), since
    parsing a GGUF header with a large vocabulary takes seconds."""
    final = converted_gguf_dir(cache_dir, gguf)
    types = None if final.is_dir() else gguf_tensor_types(gguf)  # a bad file fails before a lock

    def produce(out: Path) -> None:
        found = types if types is not None else gguf_tensor_types(gguf)
        try:
            (convert or convert_gguf)(gguf, out)
        except InvalidArgument:
            raise
        except Exception as err:
            raise InvalidArgument(
                f"--model {gguf}: transformers could not convert this GGUF file ({err}); its "
                "architecture must be one transformers' GGUF loader reads and this worker serves"
            ) from err
        (out / SOURCE_FILE).write_text(json.dumps(
            {"gguf": str(gguf.resolve()), "tensor_types": dict(found.most_common())}, indent=1))

    size_mb = gguf.stat().st_size / 1e6
    path = convert_once(final, produce, f"{gguf.name} ({size_mb:.0f} MB)")
    try:
        kept = Counter(json.loads((path / SOURCE_FILE).read_text())["tensor_types"])
    except (OSError, ValueError, KeyError, TypeError):  # converted by another version
        kept = gguf_tensor_types(gguf)
    log.info("--model %s (converted in %s): %s", gguf, path, describe_types(kept))
    return path


def convert_once(final: Path, produce: Callable[[Path], None], what: str) -> Path:
    """``final``, after ``produce`` wrote it if it was not there yet.

    ``produce`` writes into a temporary directory beside ``final``, which is checked and renamed
    into place, under a file lock: a crash leaves no half checkpoint (its leftovers are removed
    by the next conversion), and concurrent starts convert once and share the result.
    """
    if final.is_dir():
        return final
    cache_dir = final.parent
    cache_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(cache_dir / f".{final.name}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("waiting for another process converting %s into %s", what, final)
        lock.acquire()
    try:
        if final.is_dir():
            return final  # converted by the process we waited for
        for stale in cache_dir.glob(f".{final.name}.tmp-*"):
            log.info("removing %s, left by an interrupted conversion", stale)
            shutil.rmtree(stale, ignore_errors=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=cache_dir))
        try:
            log.info("converting %s once into %s", what, final)
            started = time.monotonic()
            produce(scratch)
            check_checkpoint_dir(scratch)  # a converter's output passes the --model checks
            for file in scratch.iterdir():  # mkdtemp and safetensors make them owner-only
                file.chmod(0o644)
            scratch.chmod(0o755)
            os.rename(scratch, final)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        log.info("converted in %.1f s: %s", time.monotonic() - started, final)
        return final
    finally:
        lock.release()


def require_gguf_loader() -> None:
    """Raise one line naming what to install when transformers' GGUF loader lacks a package."""
    missing = [name for name in GGUF_LOADER_NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        raise InvalidArgument(
            f"converting a GGUF model needs {' and '.join(missing)}, which is not installed: "
            f"pip install -r requirements.lock (or: pip install {' '.join(missing)})"
        )


def convert_gguf(gguf: Path, out_dir: Path, *, require_chat_template: bool = False) -> None:
    """Dequantize a GGUF file with transformers and save fp32 safetensors + tokenizer.

    Any family transformers' GGUF loader knows, and MoE files it reads short or not at all
    (``gguf_moe.py``: Qwen3-MoE / Qwen2-MoE experts' widths, Mixtral); the chat template is
    kept when the file has one (a base model's has none: it serves completions only).
    """
    require_gguf_loader()
    import torch
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reader = GGUFReader(gguf)
    if gguf_moe.is_llama_moe(reader):  # Mixtral: transformers would read a dense Llama
        gguf_moe.convert_llama_moe(gguf, reader, out_dir)
        return
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if require_chat_template and not tokenizer.chat_template:
        raise InvalidArgument(f"{gguf}: the GGUF file carries no chat template")
    quantized = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
        **gguf_moe.config_overrides(reader),  # the experts' widths it does not read
    )
    # A model loaded from GGUF is flagged as quantized and refuses save_pretrained: move its
    # (already dequantized) tensors into a plain model built from the same config.
    settings: dict[str, Any] = quantized.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        settings.pop(key, None)
    config = type(quantized.config).from_dict(settings)
    with torch.device("meta"):
        model = type(quantized)(config)
    model.load_state_dict(quantized.state_dict(), strict=True, assign=True)
    model.tie_weights()
    model.generation_config = quantized.generation_config
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    log.info(
        "converted %s (%s): hidden %d, %d layers, %d heads (%d kv), vocab %d, chat template: %s",
        gguf.name,
        config.model_type,
        config.hidden_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.vocab_size,
        "yes" if tokenizer.chat_template else "no",
    )
