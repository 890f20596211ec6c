"""Chunked reads of a staged weights file, so a stream's memory stays flat.

Each chunk is one ``os.pread`` of at most ``chunk_bytes`` at the tensor's absolute file offset;
chunks never cross a tensor boundary and zero-byte tensors produce no chunk. Example with
``chunk_bytes=4``, tensor 0 of 10 bytes and tensor 1 of 4 bytes, resuming at (0, 6)::

    (0, 6, 4 bytes) (1, 0, 4 bytes)

Reads go through ``pread`` rather than mmap because mapped pages count toward the process's
resident memory while a stream touches them.
"""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from lorastream.errors import InvalidAdapter, InvalidArgument
from lorastream.manifest import AdapterManifest, TensorChunk
from services.adapter_store.staging import StagedAdapter

DEFAULT_CHUNK_BYTES = 1 << 20
MAX_CHUNK_BYTES = 8 << 20


def check_resume_point(
    manifest: AdapterManifest, start_tensor: int, start_offset: int, chunk_bytes: int
) -> None:
    """InvalidArgument unless (start_tensor, start_offset) lies inside the adapter."""
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise InvalidArgument(f"chunk_bytes must be in 1..{MAX_CHUNK_BYTES}, got {chunk_bytes}")
    count = len(manifest.tensors)
    if not 0 <= start_tensor <= count:
        raise InvalidArgument(
            f"start_tensor {start_tensor} is out of range: {manifest.name} has {count} tensors"
        )
    if start_tensor == count:
        if start_offset != 0:
            raise InvalidArgument(f"start_offset must be 0 at the end of {manifest.name}")
        return
    nbytes = manifest.tensors[start_tensor].nbytes
    if start_offset < 0 or (start_offset >= nbytes and start_offset != 0):
        raise InvalidArgument(
            f"start_offset {start_offset} is outside tensor {start_tensor} "
            f"({manifest.tensors[start_tensor].name}, {nbytes} bytes)"
        )


def iter_chunks(
    manifest: AdapterManifest,
    path: Path,
    file_offsets: Sequence[int],
    start_tensor: int = 0,
    start_offset: int = 0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Iterator[TensorChunk]:
    """Yield the tensors of ``manifest`` from ``path`` from (start_tensor, start_offset) on.

    ``file_offsets[i]`` is the absolute byte offset of tensor ``i`` in the file. The resume point
    is checked before the first yield (InvalidArgument); a file shorter than the manifest says
    raises InvalidAdapter.
    """
    check_resume_point(manifest, start_tensor, start_offset, chunk_bytes)
    if len(file_offsets) != len(manifest.tensors):
        raise ValueError("one file offset per tensor is required")
    return _read(manifest, path, file_offsets, start_tensor, start_offset, chunk_bytes)


def _read(
    manifest: AdapterManifest,
    path: Path,
    file_offsets: Sequence[int],
    start_tensor: int,
    start_offset: int,
    chunk_bytes: int,
) -> Iterator[TensorChunk]:
    fd = os.open(path, os.O_RDONLY)
    try:
        offset = start_offset
        for index in range(start_tensor, len(manifest.tensors)):
            nbytes = manifest.tensors[index].nbytes
            while offset < nbytes:
                want = min(chunk_bytes, nbytes - offset)
                data = os.pread(fd, want, file_offsets[index] + offset)
                if len(data) != want:
                    raise InvalidAdapter(
                        f"staged file of {manifest.name} ({path}) is shorter than its manifest; "
                        "delete the adapter and preload it again"
                    )
                yield TensorChunk(index, offset, data, zlib.crc32(data))
                offset += want
            offset = 0
    finally:
        os.close(fd)


class StreamLease:
    """Keeps one adapter's staged files alive while a stream reads them (a context manager)."""

    def __init__(
        self, manifest: AdapterManifest, staged: StagedAdapter, release: Callable[[], None]
    ) -> None:
        self.manifest = manifest
        self._staged = staged
        self._release = release
        self._closed = False
        self._close_lock = threading.Lock()

    def chunks(
        self, start_tensor: int = 0, start_offset: int = 0, chunk_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> Iterator[TensorChunk]:
        """The adapter's raw tensor bytes from (start_tensor, start_offset) on, chunk by chunk."""
        if self._closed:
            raise RuntimeError("stream lease already closed")
        return iter_chunks(
            self.manifest,
            self._staged.weights_path,
            self._staged.file_offsets,
            start_tensor,
            start_offset,
            chunk_bytes,
        )

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._release()

    def __enter__(self) -> "StreamLease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
