"""The tokenizers adapters ship with (``core/adapter_tokenizer.py``), loaded once per content id.

An adapter whose manifest lists tokenizer files has its prompts encoded and its output decoded
with its own tokenizer. The files come from the store (``ReadAdapterFile``, each checked against
the manifest's sha256) or, for an adapter registered from a local directory, from that
directory; the tokenizer is built from them in a temporary directory and kept in an LRU of
``capacity`` tokenizers keyed by content id, so two names with the same files share one.

With it come the adapter's own stop ids (:class:`AdapterTokenizer`): its tokenizer's EOS, and
the ``eos_token_id`` of a ``generation_config.json`` shipped beside it, which replaces the base
model's as a fine-tuned model's generation config would in transformers.

Loading runs on the request thread that first needs it (after the adapter's name resolved,
before its prompt is tokenized), never on the step loop; concurrent requests for the same
content wait for one load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from lorastream.core.adapter_tokenizer import GENERATION_CONFIG
from lorastream.core.errors import InvalidAdapter, SourceUnavailable
from lorastream.core.manifest import AdapterManifest
from lorastream.core.store_client import StoreClient

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class AdapterTokenizer:
    """An adapter's own tokenizer and what it says about stopping (compared by identity: one
    per loaded content id)."""

    tokenizer: PreTrainedTokenizerBase
    # generation_config.json's eos_token_id when the adapter ships one (it replaces the base
    # model's), else None; the tokenizer's own EOS is added to either (RequestIntake).
    generation_eos: tuple[int, ...] | None = None

    @property
    def eos_token_id(self) -> int | None:
        eos = self.tokenizer.eos_token_id
        return None if eos is None else int(eos)


class AdapterTokenizers:
    def __init__(self, client: StoreClient | None, capacity: int) -> None:
        self._client = client
        self._capacity = capacity
        self._cache: OrderedDict[str, AdapterTokenizer] = OrderedDict()
        self._lock = threading.Lock()
        self._loading: dict[str, threading.Lock] = {}  # adapter id -> the lock of its one load

    def get(self, manifest: AdapterManifest, local: Path | None) -> AdapterTokenizer | None:
        """``manifest``'s own tokenizer, None when it ships none (it uses the base model's);
        ``local``: its directory when registered from one. Raises InvalidAdapter when the files
        do not match the manifest, SourceUnavailable when the store cannot send them."""
        if not manifest.files:
            return None
        key = manifest.adapter_id
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
            load_lock = self._loading.setdefault(key, threading.Lock())
        with load_lock:
            with self._lock:
                cached = self._cache.get(key)
            if cached is None:
                cached = self._load(manifest, local)
                with self._lock:
                    self._cache[key] = cached
                    while len(self._cache) > self._capacity:
                        self._cache.popitem(last=False)
                    self._loading.pop(key, None)
            return cached

    def _load(self, manifest: AdapterManifest, local: Path | None) -> AdapterTokenizer:
        label = f"adapter {manifest.name}"
        if local is not None:
            return _from_dir(local, label)
        if self._client is None:
            raise SourceUnavailable(f"{label}'s tokenizer is in the store, but this worker has "
                                    "none (--store)")
        with tempfile.TemporaryDirectory(prefix="adapter-tokenizer-") as tmp:
            for info in manifest.files:
                data = self._client.read_file(manifest.name, manifest.adapter_id, info.name)
                if len(data) != info.nbytes or hashlib.sha256(data).hexdigest() != info.checksum:
                    raise InvalidAdapter(f"{label}: {info.name} does not match its manifest "
                                         "checksum (corrupted in transit or on the store's disk)")
                (Path(tmp) / info.name).write_bytes(data)
            tokenizer = _from_dir(Path(tmp), label)
        log.info("loaded the tokenizer of %s (%d ids)", manifest.name, len(tokenizer.tokenizer))
        return tokenizer


def _from_dir(directory: Path, label: str) -> AdapterTokenizer:
    try:
        tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(directory))
    except Exception as err:  # any parse failure is the adapter's
        raise InvalidAdapter(f"{label}: its tokenizer does not load ({err})") from err
    return AdapterTokenizer(tokenizer, _generation_eos(directory / GENERATION_CONFIG, label))


def _generation_eos(path: Path, label: str) -> tuple[int, ...] | None:
    """``eos_token_id`` of the generation config at ``path`` (an id or a list of ids); None
    without the file or the key."""
    if not path.is_file():
        return None
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (ValueError, AttributeError) as err:
        raise InvalidAdapter(f"{label}: {path.name} is not a JSON object ({err})") from err
    if eos is None:
        return None
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise InvalidAdapter(f"{label}: {path.name}'s eos_token_id must be a token id or a list "
                             f"of token ids, not {eos!r}")
    return tuple(ids)
