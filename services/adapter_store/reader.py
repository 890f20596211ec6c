"""Chunked reads of a staged weights file, so a stream's memory stays flat.

A validated weights file holds its tensors contiguously in manifest order (validation checks the
tiling), which is exactly the stream's layout (``lorastream.core.stream_layout``): each chunk is one
``os.pread`` of ``chunk_bytes`` (less at the end) that may run across tensor boundaries. Example
with ``chunk_bytes=4``, tensor 0 of 10 bytes and tensor 1 of 4 bytes, resuming at (0, 6)::

    (0, 6, 4 bytes) (1, 0, 4 bytes)          # t0[6:10], then t1[0:4]
    from (0, 0):  (0, 0, 4) (0, 4, 4) (0, 8, 4 bytes = t0[8:10] + t1[0:2]) (1, 2, 2)

Reads go through ``pread`` rather than mmap because mapped pages count toward the process's
resident memory while a stream touches them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from lorastream.core.checksum import crc32c
from lorastream.core.errors import InvalidAdapter, InvalidArgument
from lorastream.core.manifest import AdapterManifest, TensorChunk
from lorastream.core.stream_layout import StreamLayout
from lorastream.store.staging import StagedAdapter

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
    with_crc: bool = True,
) -> Iterator[TensorChunk]:
    """Yield the tensors of ``manifest`` from ``path`` from (start_tensor, start_offset) on;
    ``with_crc=False``: each chunk's ``crc32c`` is 0, not computed (the receiver checks whole
    tensors against the manifest's digests instead).

    ``file_offsets[i]`` is the absolute byte offset of tensor ``i`` in the file. The resume point
    is checked before the first yield (InvalidArgument); a file shorter than the manifest says
    raises InvalidAdapter.
    """
    check_resume_point(manifest, start_tensor, start_offset, chunk_bytes)
    if len(file_offsets) != len(manifest.tensors):
        raise ValueError("one file offset per tensor is required")
    return _read(manifest, path, file_offsets, start_tensor, start_offset, chunk_bytes, with_crc)


def _read(
    manifest: AdapterManifest,
    path: Path,
    file_offsets: Sequence[int],
    start_tensor: int,
    start_offset: int,
    chunk_bytes: int,
    with_crc: bool,
) -> Iterator[TensorChunk]:
    layout = StreamLayout(manifest)
    base = file_offsets[0] if file_offsets else 0
    if any(off != base + start for off, start in zip(file_offsets, layout.starts, strict=True)):
        raise InvalidAdapter(
            f"staged file of {manifest.name} ({path}) does not hold its tensors contiguously in "
            "manifest order; delete the adapter and preload it again"
        )
    fd = os.open(path, os.O_RDONLY)
    try:
        flat = layout.flat(start_tensor, start_offset)
        while flat < layout.total:
            want = min(chunk_bytes, layout.total - flat)
            data = os.pread(fd, want, base + flat)
            if len(data) != want:
                raise InvalidAdapter(
                    f"staged file of {manifest.name} ({path}) is shorter than its manifest; "
                    "delete the adapter and preload it again"
                )
            index, offset = layout.position(flat)
            yield TensorChunk(index, offset, data, crc32c(data) if with_crc else 0)
            flat += want
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
        self, start_tensor: int = 0, start_offset: int = 0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES, with_crc: bool = True,
    ) -> Iterator[TensorChunk]:
        """The adapter's raw tensor bytes from (start_tensor, start_offset) on, chunk by chunk
        (``with_crc``: see :func:`iter_chunks`)."""
        if self._closed:
            raise RuntimeError("stream lease already closed")
        return iter_chunks(
            self.manifest,
            self._staged.weights_path,
            self._staged.file_offsets,
            start_tensor,
            start_offset,
            chunk_bytes,
            with_crc,
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
