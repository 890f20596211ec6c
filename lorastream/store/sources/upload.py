"""A pushed adapter: the bytes of one upload stream, read by the stager like any other source.

Unlike S3, the Hub or local paths, an upload is not found by URI: each push makes one
:class:`UploadSource` around its stream (the header already read, the chunks still arriving) and
hands it to the store, which stages it through the same ``Stager.prepare`` (download into
``cache/tmp``, validate, hash, rename). Every check that can be made before a byte arrives is made
in :meth:`UploadSource.resolve` (file names, declared sizes, ``max_upload_bytes``); the rest as
the bytes arrive: chunks in order, CRC-32C, never more than a file's declared size, and exactly
that size in the end. Any failure raises, and the stager removes its temp dir.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from lorastream.core.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from lorastream.core.adapter_tokenizer import TOKENIZER_FILES
from lorastream.core.checksum import crc32c
from lorastream.core.errors import CapacityExhausted, InvalidAdapter, InvalidArgument
from lorastream.core.upload import UploadChunk, UploadHeader
from lorastream.store.sources.base import (
    AdapterSource,
    ProgressCallback,
    ResolvedSource,
    select_adapter_files,
)

log = logging.getLogger(__name__)

_UPLOAD_FILES = (CONFIG_FILE, WEIGHTS_FILE, *TOKENIZER_FILES)


class UploadSource(AdapterSource):
    """The files of one upload, written into the stager's directory as their chunks arrive."""

    schemes = ()  # one per upload, never registered by scheme

    def __init__(
        self, header: UploadHeader, chunks: Iterator[UploadChunk], max_upload_bytes: int
    ) -> None:
        self._header = header
        self._chunks = chunks
        self._max_bytes = max_upload_bytes

    def resolve(self, uri: str) -> ResolvedSource:
        """Check the header: the two PEFT files and the adapter's tokenizer's, once each, sizes
        within ``max_upload_bytes``."""
        paths = [f.path for f in self._header.files]
        unknown = sorted(set(paths) - set(_UPLOAD_FILES))
        if unknown:
            raise InvalidArgument(
                f"{uri}: an upload holds only {CONFIG_FILE}, {WEIGHTS_FILE} and the adapter's "
                f"tokenizer files ({', '.join(TOKENIZER_FILES)}); got "
                f"{', '.join(repr(p) for p in unknown)}"
            )
        if len(set(paths)) != len(paths):
            raise InvalidArgument(f"{uri}: the upload header lists a file twice")
        negative = [f.path for f in self._header.files if f.size < 0]
        if negative:
            raise InvalidArgument(f"{uri}: negative size declared for {', '.join(negative)}")
        total = self._header.total_bytes
        if total > self._max_bytes:
            raise CapacityExhausted(
                f"{uri}: the upload is {total} bytes, more than the store accepts in one upload "
                f"({self._max_bytes} bytes, --max-upload-bytes); raise that limit on the store "
                "or push a smaller adapter"
            )
        files = select_adapter_files({f.path: f.size for f in self._header.files}, uri)
        return ResolvedSource(uri=uri, revision="", files=files)

    def download(self, resolved: ResolvedSource, dest: Path, progress: ProgressCallback) -> None:
        files = self._header.files
        outputs: list[BinaryIO] = []
        try:
            for f in files:
                outputs.append((dest / f.path).open("wb"))
            written = [0] * len(files)
            current = self._next_file(written, 0)
            for chunk in self._chunks:
                self._check(resolved.uri, chunk, current, written)
                outputs[current].write(chunk.data)
                written[current] += len(chunk.data)
                progress(len(chunk.data))
                current = self._next_file(written, current)
        finally:
            for out in outputs:
                out.close()
        if current < len(files):
            done, total = sum(written), self._header.total_bytes
            raise InvalidAdapter(
                f"{resolved.uri}: the upload ended after {done} of {total} declared bytes "
                f"({files[current].path} is short); nothing was staged: push it again"
            )
        log.debug("received %d bytes for %s", self._header.total_bytes, resolved.uri)

    def _next_file(self, written: list[int], current: int) -> int:
        """The first file from ``current`` on that still expects bytes (len(files): none)."""
        files = self._header.files
        while current < len(files) and written[current] == files[current].size:
            current += 1
        return current

    def _check(self, uri: str, chunk: UploadChunk, current: int, written: list[int]) -> None:
        files = self._header.files
        if current >= len(files):
            raise InvalidArgument(
                f"{uri}: a chunk arrived after every declared byte; declare the files' exact sizes"
            )
        if (chunk.file_index, chunk.offset) != (current, written[current]):
            raise InvalidArgument(
                f"{uri}: chunk of file {chunk.file_index} at offset {chunk.offset} out of order; "
                f"expected file {current} ({files[current].path}) at offset {written[current]}"
            )
        if written[current] + len(chunk.data) > files[current].size:
            raise InvalidArgument(
                f"{uri}: more bytes arrived for {files[current].path} than the "
                f"{files[current].size} its header declared"
            )
        if crc32c(chunk.data) != chunk.crc32c:
            raise InvalidAdapter(
                f"{uri}: CRC-32C mismatch in {files[current].path} at offset {chunk.offset}: the "
                "upload was corrupted in transit; push it again"
            )
