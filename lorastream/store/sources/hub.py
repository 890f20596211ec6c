"""Adapters in Hugging Face Hub model repos: ``hf://org/repo[/sub/dir][@revision]``.

``resolve`` pins the revision (a branch, tag, ``refs/pr/N`` or sha; ``main`` by default) to its
40-hex commit sha and lists the folder; ``download`` fetches at that sha, so a branch that moves
in between cannot mix two versions.

The endpoint and token are constructor arguments (the store's config reads ``HF_ENDPOINT`` and
``HF_TOKEN``); huggingface_hub's own environment defaults are never relied on, and without a
token no token is sent, not even one from ``hf auth login``. Downloads go through a
huggingface_hub cache: by default a scratch cache inside ``dest`` that is removed afterwards (only
the adapter files remain, moved into place), or a persistent ``cache_dir`` the files are hardlinked
(or copied) from. A persistent cache is outside the store's byte budget.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import threading
from pathlib import Path
from types import TracebackType
from typing import NoReturn
from urllib.parse import unquote

import httpx2
from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile

from lorastream.core.errors import (
    AdapterNotFound,
    InvalidArgument,
    LorastreamError,
    SourceUnavailable,
    Unauthenticated,
)
from lorastream.store.sources.base import (
    AdapterSource,
    ProgressCallback,
    ResolvedSource,
    select_adapter_files,
)

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_REVISION = "main"
SCRATCH_CACHE = ".hub-cache"  # inside dest while downloading without a persistent cache

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_SHA = re.compile(r"^[0-9a-f]{40}$")
_OTHER_REPO_TYPES = ("datasets", "spaces")


def parse_hf_uri(uri: str) -> tuple[str, str, str]:
    """``hf://org/repo/sub/dir@rev`` -> ``("org/repo", "sub/dir", "rev")``.

    The revision follows the first ``@`` and may hold slashes (``refs/pr/1``); it defaults to
    ``main``. The subfolder is optional (``""``). InvalidArgument on anything malformed or unsafe.
    """
    if not uri.lower().startswith("hf://"):
        raise InvalidArgument(f"{uri}: not an hf:// URI; expected hf://org/repo[@revision]")
    path, at, revision = uri[len("hf://") :].partition("@")
    revision = unquote(revision) if at else DEFAULT_REVISION
    if not revision or revision.strip() != revision or any(ord(c) < 33 for c in revision):
        raise InvalidArgument(f"{uri}: empty or malformed revision after '@'")
    if path.endswith("/"):
        path = path[:-1]
    parts = path.split("/")
    if len(parts) < 2:
        raise InvalidArgument(f"{uri}: expected hf://org/repo[/subfolder][@revision]")
    if parts[0] in _OTHER_REPO_TYPES:
        raise InvalidArgument(f"{uri}: only model repos hold adapters; drop the {parts[0]}/ part")
    org, name, sub = parts[0], parts[1], parts[2:]
    for part in (org, name):
        if not _NAME.match(part) or ".." in part or "--" in part:
            raise InvalidArgument(
                f"{uri}: {part!r} is not a valid Hub name (letters, digits, '.', '_', '-'; no "
                "'..' or '--'); expected hf://org/repo[@revision]"
            )
    for segment in sub:
        if segment in ("", ".", "..") or "\\" in segment or any(ord(c) < 32 for c in segment):
            raise InvalidArgument(
                f"{uri}: empty, '.' and '..' subfolder segments are refused (path traversal)"
            )
    return f"{org}/{name}", "/".join(sub), revision


class _ProgressRelay:
    """Stands in for huggingface_hub's tqdm bar: forwards ``update(n)`` to a byte counter."""

    def __init__(self, counter: _ByteCounter, **_bar_options: object) -> None:
        self._counter = counter

    def __enter__(self) -> _ProgressRelay:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None

    def update(self, n: float | None = 1) -> None:
        self._counter.add(int(n or 0))  # negative when huggingface_hub restarts a download

    def close(self) -> None:
        return None


class _ByteCounter:
    def __init__(self, progress: ProgressCallback) -> None:
        self._progress = progress
        self._lock = threading.Lock()
        self.total = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.total += n
        self._progress(n)


class HubSource(AdapterSource):
    """Fetches PEFT directories from a Hugging Face Hub (or a mirror speaking its protocol)."""

    schemes = ("hf",)

    def __init__(
        self,
        endpoint: str | None = None,
        token: str | None = None,
        cache_dir: Path | None = None,
        *,
        timeout: float = 30.0,
    ) -> None:
        self._endpoint = (endpoint or DEFAULT_ENDPOINT).rstrip("/")
        self._token: str | bool = token or False  # False: send no token at all
        self._cache_dir = cache_dir
        self._timeout = timeout
        self._api = HfApi(endpoint=self._endpoint, token=self._token)

    def resolve(self, uri: str) -> ResolvedSource:
        repo_id, subfolder, revision = parse_hf_uri(uri)
        try:
            info = self._api.model_info(
                repo_id, revision=revision, token=self._token, timeout=self._timeout
            )
            sha = info.sha
            if sha is None or not _SHA.match(sha):
                raise SourceUnavailable(
                    f"{uri}: the Hub at {self._endpoint} did not report a commit sha for "
                    f"{revision!r}"
                )
            entries = list(
                self._api.list_repo_tree(
                    repo_id, path_in_repo=subfolder or None, revision=sha, token=self._token
                )
            )
        except Exception as err:
            self._raise_mapped(err, uri, revision)
        prefix = f"{subfolder}/" if subfolder else ""
        listing: dict[str, int] = {}
        for entry in entries:
            if not isinstance(entry, RepoFile) or not entry.path.startswith(prefix):
                continue
            name = entry.path[len(prefix) :]
            if "/" not in name and name not in ("", ".", ".."):
                listing[name] = int(entry.size)
        files = select_adapter_files(listing, uri)
        log.debug("resolved %s to %s", uri, sha)
        return ResolvedSource(uri=uri, revision=sha, files=files)

    def download(self, resolved: ResolvedSource, dest: Path, progress: ProgressCallback) -> None:
        repo_id, subfolder, _ = parse_hf_uri(resolved.uri)
        sha = resolved.revision
        if not _SHA.match(sha):
            raise InvalidArgument(
                f"{resolved.uri}: download needs a resolved commit sha, got {sha!r}"
            )
        cache = self._cache_dir or dest / SCRATCH_CACHE
        try:
            for remote in resolved.files:
                if "/" in remote.path or remote.path in ("", ".", ".."):
                    raise InvalidArgument(f"{resolved.uri}: refusing file name {remote.path!r}")
                counter = _ByteCounter(progress)
                # huggingface_hub types tqdm_class as type[tqdm]; it calls it to make a bar, so a
                # callable that makes a bar-like object does
                relay = functools.partial(_ProgressRelay, counter)
                try:
                    cached = hf_hub_download(
                        repo_id,
                        remote.path,
                        subfolder=subfolder or None,
                        revision=sha,
                        endpoint=self._endpoint,
                        token=self._token,
                        cache_dir=cache,
                        tqdm_class=relay,  # type: ignore[call-overload]  # any bar maker will do
                    )
                except Exception as err:
                    self._raise_mapped(err, resolved.uri, sha)
                self._place(Path(cached), dest / remote.path)
                if remote.size > counter.total:  # served from a persistent cache
                    counter.add(remote.size - counter.total)
        finally:
            if self._cache_dir is None:
                shutil.rmtree(cache, ignore_errors=True)
        log.debug("downloaded %d files of %s at %s", len(resolved.files), resolved.uri, sha)

    def _place(self, cached: Path, target: Path) -> None:
        """Move (scratch cache) or hardlink/copy (persistent cache) a cached file to ``target``."""
        blob = cached.resolve()
        if self._cache_dir is None:
            os.replace(blob, target)
            return
        try:
            os.link(blob, target)
        except OSError:
            shutil.copyfile(blob, target)

    def _raise_mapped(self, err: Exception, uri: str, revision: str) -> NoReturn:
        """Raise the domain error for a huggingface_hub failure; local disk errors pass through."""
        if isinstance(err, LorastreamError):
            raise err
        if (isinstance(err, OSError) and not isinstance(err, HfHubHTTPError)
                and err.errno is not None and not isinstance(err, LocalEntryNotFoundError)):
            raise err  # local disk trouble (e.g. ENOSPC): the stager reports it
        raise self._mapped(err, uri, revision) from err

    def _mapped(self, err: Exception, uri: str, revision: str) -> LorastreamError:
        hub = self._endpoint
        token_hint = (
            "the store's Hub token was refused or lacks access; check HF_TOKEN "
            "(LORASTREAM_STORE_HF_TOKEN)"
            if self._token
            else "the store has no Hub token; set HF_TOKEN (LORASTREAM_STORE_HF_TOKEN) to one "
            "with read access"
        )
        if isinstance(err, GatedRepoError):
            return Unauthenticated(
                f"{uri}: the repo is gated at {hub}; accept its terms on the Hub, and {token_hint}"
            )
        if isinstance(err, RepositoryNotFoundError):
            if err.response.status_code in (401, 403):
                return Unauthenticated(
                    f"{uri}: {hub} refused access ({err.response.status_code}): the repo does "
                    f"not exist or is private, and {token_hint}"
                )
            return AdapterNotFound(f"{uri}: no such model repo at {hub}; check org/repo")
        if isinstance(err, RevisionNotFoundError):
            return AdapterNotFound(
                f"{uri}: revision {revision!r} not found; use a branch, tag or commit sha of "
                "the repo"
            )
        if isinstance(err, RemoteEntryNotFoundError):
            return AdapterNotFound(f"{uri}: no such folder or file in the repo at {revision!r}")
        if isinstance(err, HfHubHTTPError):
            status = err.response.status_code
            if status in (401, 403):
                return Unauthenticated(f"{uri}: {hub} refused access ({status}); {token_hint}")
            if status == 400:
                return InvalidArgument(f"{uri}: the Hub rejected the request: {err}")
            return SourceUnavailable(f"{uri}: the Hub at {hub} failed ({status}); retry later")
        if isinstance(err, OfflineModeIsEnabled):
            return SourceUnavailable(f"{uri}: huggingface_hub is in offline mode (HF_HUB_OFFLINE)")
        if isinstance(err, (LocalEntryNotFoundError, httpx2.TransportError)):
            cause = err.__cause__ or err
            return SourceUnavailable(
                f"{uri}: cannot reach the Hub at {hub} ({type(cause).__name__}: {cause}); check "
                "HF_ENDPOINT and the network"
            )
        if isinstance(err, HFValidationError):
            return InvalidArgument(f"{uri}: {err}")
        return SourceUnavailable(f"{uri}: Hub download failed: {type(err).__name__}: {err}")
