"""Adapters on the store's own file system: ``file:///abs/path`` and plain absolute paths."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import unquote, urlsplit

from lorastream.core.errors import AdapterNotFound, InvalidArgument, SourceUnavailable
from lorastream.store.sources.base import (
    AdapterSource,
    ProgressCallback,
    ResolvedSource,
    select_adapter_files,
)

log = logging.getLogger(__name__)

_COPY_CHUNK = 1 << 20


class LocalSource(AdapterSource):
    """Copies a PEFT directory from a local path into the stager's directory.

    Paths are taken as the store process sees them, so they must be absolute (a relative path
    would silently depend on the store's working directory). With ``allowed_roots`` (the
    server always passes them; an empty list refuses every path), a path is taken only when it
    and each file read from it, symlinks resolved, lie under one of the roots; a path outside is
    refused with one message, before anything is looked up, so that the answer tells nothing
    about what exists on the store's host.
    """

    schemes = ("file", "")
    _roots: tuple[Path, ...] | None = None  # None: any path (the store core's own tests)

    def __init__(self, allowed_roots: Sequence[Path] | None = None) -> None:
        self._roots = (
            None if allowed_roots is None
            else tuple(Path(os.path.realpath(root)) for root in allowed_roots)
        )

    def _check_allowed(self, uri: str, path: Path) -> Path:
        """``path`` with symlinks resolved; InvalidArgument unless it is under an allowed root."""
        if self._roots is None:
            return path
        real = Path(os.path.realpath(path))
        if not any(real.is_relative_to(root) for root in self._roots):
            allowed = ", ".join(str(root) for root in self._roots) or "none"
            raise InvalidArgument(
                f"{uri}: local adapter paths must lie under the store's allowed local roots "
                f"({allowed}); start the store with --allowed-local-root DIR to allow one "
                "(`lorastream up --allowed-local-root DIR` for the stack `up` starts)"
            )
        return real

    def directory_of(self, uri: str) -> Path:
        """The absolute directory ``uri`` names (not checked for existence)."""
        parts = urlsplit(uri)
        if parts.scheme == "file":
            if parts.netloc not in ("", "localhost"):
                raise InvalidArgument(
                    f"{uri}: file:// URIs name a path on the store's host; use file:///abs/path"
                )
            raw = unquote(parts.path)
        elif parts.scheme == "":
            raw = uri
        else:
            raise InvalidArgument(f"{uri}: LocalSource handles file:// URIs and plain paths only")
        path = Path(raw)
        if not path.is_absolute():
            raise InvalidArgument(
                f"{uri}: local adapter paths must be absolute (the store resolves them on its "
                "own host, not in your working directory)"
            )
        return self._check_allowed(uri, path)

    def resolve(self, uri: str) -> ResolvedSource:
        directory = self.directory_of(uri)
        if not directory.exists():
            raise AdapterNotFound(f"{uri}: no such directory on the adapter store's host")
        if not directory.is_dir():
            raise InvalidArgument(
                f"{uri} is a file; point at the PEFT directory that holds it instead"
            )
        try:
            listing = {
                entry.name: entry.stat().st_size
                for entry in os.scandir(directory)
                if entry.is_file()
            }
        except OSError as err:
            raise SourceUnavailable(f"{uri}: cannot list the directory: {err}") from err
        files = select_adapter_files(listing, uri)
        return ResolvedSource(uri=uri, revision="", files=files)

    def download(self, resolved: ResolvedSource, dest: Path, progress: ProgressCallback) -> None:
        directory = self.directory_of(resolved.uri)
        for remote in resolved.files:
            source_path = self._check_allowed(resolved.uri, directory / remote.path)
            try:
                src = source_path.open("rb")
            except FileNotFoundError as err:
                raise AdapterNotFound(f"{resolved.uri}: {remote.path} disappeared") from err
            except OSError as err:
                raise SourceUnavailable(
                    f"{resolved.uri}: cannot read {remote.path}: {err}"
                ) from err
            with src, (dest / remote.path).open("wb") as out:
                while chunk := src.read(_COPY_CHUNK):
                    out.write(chunk)
                    progress(len(chunk))
        log.debug("copied %d files from %s", len(resolved.files), directory)

