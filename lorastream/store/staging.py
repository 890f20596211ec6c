"""Staging: fetch an adapter into the cache, verify it, and make it visible in one atomic rename.

Layout of the cache directory::

    cache/tmp/<random>/          downloads in progress (removed at startup: crash leftovers)
    cache/adapters/<adapter_id>/ adapter_config.json, adapter_model.safetensors, manifest.json,
                                 and the adapter's tokenizer files if it ships them

``adapter_id`` is the sha256 over the staged files in a fixed order (each file contributes its
name, its size and its bytes), so two URIs with the same files share one directory. A directory
under ``adapters/`` is only ever created by ``os.rename`` of a complete, validated, fsynced temp
dir: a corrupt file, a full disk or a crash leaves nothing half-written there.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorastream.core.adapter_format import WEIGHTS_FILE
from lorastream.core.adapter_validation import (
    StagedTensor,
    ValidatedAdapter,
    content_id,
    staged_files,
    validate_adapter_dir,
)
from lorastream.core.checksum import DEFAULT_TENSOR_DIGEST, TENSOR_DIGESTS
from lorastream.core.errors import CapacityExhausted, InvalidAdapter
from lorastream.core.manifest import AdapterFile, AdapterManifest, PreloadProgress, TensorInfo
from lorastream.store.digesting import StreamDigests
from lorastream.store.sources.base import AdapterSource, ResolvedSource

log = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
_MANIFEST_FORMAT = 1
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_PROGRESS_STEP = 1 << 20  # emit a downloading event at least every MiB (or 1 % of the total)

# phase, bytes done, bytes total
PhaseCallback = Callable[[str, int, int], None]
ProgressFn = Callable[[PreloadProgress], None]


@dataclass(frozen=True)
class StagedAdapter:
    """One adapter directory under ``cache/adapters``: content only, no name."""

    adapter_id: str
    directory: Path
    content: ValidatedAdapter
    created_at: float
    size_bytes: int  # on disk, manifest included

    @property
    def weights_path(self) -> Path:
        return self.directory / WEIGHTS_FILE

    @property
    def file_offsets(self) -> tuple[int, ...]:
        return tuple(t.file_offset for t in self.content.tensors)

    def manifest(
        self,
        *,
        name: str,
        source_uri: str,
        revision: str,
        created_at: float,
        pinned: bool,
        last_used_at: float,
    ) -> AdapterManifest:
        return self.content.manifest(
            adapter_id=self.adapter_id, name=name, source_uri=source_uri, revision=revision,
            created_at=created_at, pinned=pinned, last_used_at=last_used_at,
        )


@dataclass(frozen=True)
class PreparedAdapter:
    """A validated adapter in a temp dir, ready for :meth:`Stager.commit`."""

    temp_dir: Path
    adapter_id: str
    content: ValidatedAdapter
    created_at: float

    @property
    def size_bytes(self) -> int:
        return _dir_bytes(self.temp_dir)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _dir_bytes(directory: Path) -> int:
    return sum(entry.stat().st_size for entry in os.scandir(directory) if entry.is_file())


def _manifest_json(prepared: PreparedAdapter) -> dict[str, object]:
    c = prepared.content
    return {
        "format": _MANIFEST_FORMAT,
        "adapter_id": prepared.adapter_id,
        "created_at": prepared.created_at,
        "base_model": c.base_model,
        "rank": c.rank,
        "alpha": c.alpha,
        "use_rslora": c.use_rslora,
        "target_modules": list(c.target_modules),
        "alora_invocation_tokens": list(c.alora_invocation_tokens),
        "token_indices": list(c.token_indices),
        "files": [{"name": f.name, "nbytes": f.nbytes, "checksum": f.checksum} for f in c.files],
        "tokenizer_vocab": c.tokenizer_vocab,
        "rank_pattern": [list(p) for p in c.rank_pattern],
        "alpha_pattern": [list(p) for p in c.alpha_pattern],
        "default_rank": c.default_rank,
        "tensors": [
            {
                "name": t.info.name,
                "dtype": t.info.dtype,
                "shape": list(t.info.shape),
                "nbytes": t.info.nbytes,
                "checksum": t.info.checksum,
                "fast_checksum": t.info.fast_checksum,
                "file_offset": t.file_offset,
            }
            for t in c.tensors
        ],
    }


def _content_from_json(doc: dict[str, Any]) -> ValidatedAdapter:
    tensors = tuple(
        StagedTensor(
            TensorInfo(
                name=t["name"],
                dtype=t["dtype"],
                shape=tuple(t["shape"]),
                nbytes=t["nbytes"],
                checksum=t["checksum"],
                fast_checksum=t.get("fast_checksum", ""),  # "" when staged before it existed
            ),
            file_offset=t["file_offset"],
        )
        for t in doc["tensors"]
    )
    return ValidatedAdapter(
        base_model=str(doc["base_model"]),
        rank=int(doc["rank"]),
        alpha=float(doc["alpha"]),
        use_rslora=bool(doc["use_rslora"]),
        target_modules=tuple(doc["target_modules"]),
        tensors=tensors,
        # () when staged before activated LoRA was served (such adapters were refused then)
        alora_invocation_tokens=tuple(doc.get("alora_invocation_tokens", ())),
        token_indices=tuple(doc.get("token_indices", ())),
        # () / 0 when staged before adapters' tokenizers were kept
        files=tuple(AdapterFile(f["name"], f["nbytes"], f["checksum"])
                    for f in doc.get("files", ())),
        tokenizer_vocab=int(doc.get("tokenizer_vocab", 0)),
        # () / 0 when staged before per-module ranks were served (such adapters were refused)
        rank_pattern=tuple((str(k), float(v)) for k, v in doc.get("rank_pattern", ())),
        alpha_pattern=tuple((str(k), float(v)) for k, v in doc.get("alpha_pattern", ())),
        default_rank=int(doc.get("default_rank", 0)),
    )


class Stager:
    """Owns ``cache/tmp`` and ``cache/adapters``; knows nothing about names or budgets."""

    def __init__(
        self, cache_dir: Path, max_header_bytes: int, tensor_digest: str = DEFAULT_TENSOR_DIGEST
    ) -> None:
        if tensor_digest not in TENSOR_DIGESTS:
            raise ValueError(
                f"unknown tensor digest {tensor_digest!r}: use one of {', '.join(TENSOR_DIGESTS)}"
            )
        self.tensor_digest = tensor_digest  # each staged tensor's fast checksum (core/checksum.py)
        self.cache_dir = cache_dir
        self.tmp_dir = cache_dir / "tmp"
        self.adapters_dir = cache_dir / "adapters"
        self.max_header_bytes = max_header_bytes
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        self.adapters_dir.mkdir(parents=True, exist_ok=True)

    def remove_stale_temp(self) -> int:
        """Delete every leftover under ``cache/tmp`` (call before serving); returns the count."""
        removed = 0
        for entry in os.scandir(self.tmp_dir):
            log.warning("removing stale staging leftover %s", entry.path)
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.unlink(entry.path)
            removed += 1
        return removed

    def prepare(
        self, source: AdapterSource, resolved: ResolvedSource, on_phase: PhaseCallback
    ) -> PreparedAdapter:
        """Download, validate, hash and write the manifest, all inside a fresh temp dir.

        On any failure the temp dir is removed; a full disk raises CapacityExhausted.
        """
        temp_dir = Path(tempfile.mkdtemp(prefix="stage-", dir=self.tmp_dir))
        try:
            return self._prepare_in(temp_dir, source, resolved, on_phase)
        except OSError as err:
            shutil.rmtree(temp_dir, ignore_errors=True)
            if err.errno in _DISK_FULL:
                raise CapacityExhausted(
                    f"disk full while staging {resolved.uri} into {self.cache_dir} ({err}); free "
                    "space on that file system or lower the cache budget"
                ) from err
            raise
        except BaseException:
            shutil.rmtree(temp_dir, ignore_errors=True)
            raise

    def _prepare_in(
        self,
        temp_dir: Path,
        source: AdapterSource,
        resolved: ResolvedSource,
        on_phase: PhaseCallback,
    ) -> PreparedAdapter:
        total = resolved.total_bytes
        done = 0
        lock = threading.Lock()  # sources may report from several download threads

        def downloaded(n: int) -> None:
            nonlocal done
            with lock:
                done += n
                on_phase("downloading", done, total)

        on_phase("downloading", 0, total)
        digests = StreamDigests(self.tensor_digest, self.max_header_bytes)
        source.download_digested(resolved, temp_dir, downloaded, digests)
        on_phase("validating", done, total)
        content = validate_adapter_dir(
            temp_dir, max_header_bytes=self.max_header_bytes, label=resolved.uri,
            tensor_digest=self.tensor_digest, hashed=digests.tensors,
        )
        on_phase("staging", done, total)
        files = staged_files(temp_dir)
        for name in files:
            _fsync_path(temp_dir / name)
        hashed = digests.content_id if digests.files == files else None
        adapter_id = hashed or content_id(temp_dir)  # hashed while downloading?
        prepared = PreparedAdapter(temp_dir, adapter_id, content, time.time())
        manifest_path = temp_dir / MANIFEST_FILE
        with manifest_path.open("w") as f:
            json.dump(_manifest_json(prepared), f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_path(temp_dir)
        return prepared

    def commit(self, prepared: PreparedAdapter) -> tuple[StagedAdapter, bool]:
        """Rename the temp dir to ``adapters/<id>``; reuse an existing copy of the same content.

        Returns the staged adapter and whether it is new. The caller serialises commits and
        removals of the same id (the store holds its lock).
        """
        target = self.adapters_dir / prepared.adapter_id
        if target.exists():
            shutil.rmtree(prepared.temp_dir, ignore_errors=True)
            log.info("content %s already staged; reusing it", prepared.adapter_id[:12])
            return self.load(prepared.adapter_id), False
        os.rename(prepared.temp_dir, target)
        _fsync_path(self.adapters_dir)
        staged = StagedAdapter(
            prepared.adapter_id, target, prepared.content, prepared.created_at, _dir_bytes(target)
        )
        return staged, True

    def discard(self, prepared: PreparedAdapter) -> None:
        shutil.rmtree(prepared.temp_dir, ignore_errors=True)

    def staged_ids(self) -> list[str]:
        return sorted(entry.name for entry in os.scandir(self.adapters_dir) if entry.is_dir())

    def load(self, adapter_id: str) -> StagedAdapter:
        """Read ``adapters/<id>/manifest.json``; InvalidAdapter when it is missing or corrupt."""
        directory = self.adapters_dir / adapter_id
        try:
            doc = json.loads((directory / MANIFEST_FILE).read_text())
            if doc.get("format") != _MANIFEST_FORMAT or doc.get("adapter_id") != adapter_id:
                raise ValueError("format or id does not match")
            content = _content_from_json(doc)
            size = _dir_bytes(directory)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise InvalidAdapter(f"staged adapter {directory} is unreadable ({err})") from err
        return StagedAdapter(adapter_id, directory, content, float(doc["created_at"]), size)

    def remove(self, adapter_id: str) -> None:
        """Make ``adapters/<id>`` disappear at once (rename into tmp), then delete its files."""
        directory = self.adapters_dir / adapter_id
        trash = self.tmp_dir / f"trash-{adapter_id[:16]}-{os.urandom(4).hex()}"
        try:
            os.rename(directory, trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)
        log.info("removed staged adapter %s", adapter_id[:12])


class SharedDownload:
    """One download of a URI, shared by every preload that asks for it meanwhile.

    The first preload runs the download and reports phases through :meth:`on_phase`; later ones
    subscribe (and get the latest event at once), wait on ``finished``, then read ``result`` or
    ``error``.
    """

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.participants = 1  # preloads waiting on this flight; guarded by the store lock
        self.finished = threading.Event()
        self.result: tuple[StagedAdapter, str] | None = None  # staged content, revision
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._listeners: list[ProgressFn] = []
        self._last: PreloadProgress | None = None
        self._last_bytes = 0

    # Listeners run under the lock, so each sees events in order; they must be cheap (a queue put).
    def subscribe(self, listener: ProgressFn) -> None:
        with self._lock:
            self._listeners.append(listener)
            if self._last is not None:
                _call(listener, self._last)

    def unsubscribe(self, listener: ProgressFn) -> None:
        with self._lock:
            self._listeners.remove(listener)

    def on_phase(self, phase: str, done: int, total: int) -> None:
        """Broadcast an event; downloading events are thinned to about one per MiB or 1 %."""
        with self._lock:
            last = self._last
            if phase == "downloading" and last is not None and last.phase == phase:
                finished = 0 < total <= done
                if not finished and done - self._last_bytes < max(_PROGRESS_STEP, total // 100):
                    return
            self._last_bytes = done
            self._last = event = PreloadProgress(phase, done, max(total, done))
            for listener in self._listeners:
                _call(listener, event)


def _call(listener: ProgressFn, event: PreloadProgress) -> None:
    try:
        listener(event)
    except Exception:
        log.exception("progress listener failed")
