"""Chunked reads of a staged weights file, so a stream's memory stays flat.

The stream lays the tensors end to end in manifest order (``lorastream.core.stream_layout``) and a
chunk may run across tensor boundaries. The file holds them contiguously in its own order
(validation checks the tiling), which is lexicographic by key; the manifest lists them in layer
order (``adapter_validation.layer_order``). So a chunk is read as the few file ranges it covers:
one ``os.pread`` per run of manifest-consecutive tensors that also follow each other in the file
(a manifest staged before layer order is in file order: one run, one read per chunk). Example with
``chunk_bytes=4``, tensor 0 of 10 bytes at file offset 20 and tensor 1 of 4 bytes at offset 8,
resuming at (0, 6)::

    (0, 6, 4 bytes) (1, 0, 4 bytes)          # t0[6:10] = file[26:30], then t1[0:4] = file[8:12]
    from (0, 0):  (0, 0, 4) (0, 4, 4) (0, 8, 4 bytes = t0[8:10] + t1[0:2]) (1, 2, 2)
                                      # the third chunk: file[28:30] + file[8:10], two reads

Reads go through ``pread`` rather than mmap because mapped pages count toward the process's
resident memory while a stream touches them.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from lorastream.core.checksum import crc32c
from lorastream.core.errors import AdapterNotFound, InvalidAdapter, InvalidArgument
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


class FileRuns:
    """Where the stream's flat bytes lie in the file: runs of manifest-consecutive tensors that
    are contiguous in the file too, as (flat start, file offset, length)."""

    def __init__(self, layout: StreamLayout, file_offsets: Sequence[int]) -> None:
        runs: list[tuple[int, int, int]] = []
        for index, size in enumerate(layout.sizes):
            if not size:
                continue  # an empty tensor takes no bytes, in the stream or the file
            if runs and runs[-1][1] + runs[-1][2] == file_offsets[index]:
                flat, file_offset, length = runs[-1]
                runs[-1] = (flat, file_offset, length + size)
            else:
                runs.append((layout.starts[index], file_offsets[index], size))
        self.runs = runs
        self._flat_starts = [flat for flat, _, _ in runs]

    def ranges(self, flat: int, length: int) -> Iterator[tuple[int, int]]:
        """The (file offset, length) ranges of flat bytes ``[flat, flat + length)``, in order."""
        k = bisect.bisect_right(self._flat_starts, flat) - 1
        end = flat + length
        while flat < end:
            run_flat, file_offset, run_length = self.runs[k]
            take = min(end, run_flat + run_length) - flat
            yield file_offset + flat - run_flat, take
            flat += take
            k += 1


def _pread_ranges(fd: int, ranges: list[tuple[int, int]], total: int) -> bytes | memoryview | None:
    """The bytes of ``ranges`` (``total`` in all) read end to end; None if the file is short.
    One range is one ``pread``; more land in one buffer, each read into its place."""
    if len(ranges) == 1:
        data = os.pread(fd, total, ranges[0][0])
        return data if len(data) == total else None
    buffer = bytearray(total)
    view = memoryview(buffer)
    at = 0
    for file_offset, length in ranges:
        if os.preadv(fd, [view[at : at + length]], file_offset) != length:
            return None
        at += length
    return view


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
    runs = FileRuns(layout, file_offsets)
    fd = os.open(path, os.O_RDONLY)
    try:
        flat = layout.flat(start_tensor, start_offset)
        while flat < layout.total:
            want = min(chunk_bytes, layout.total - flat)
            data = _pread_ranges(fd, list(runs.ranges(flat, want)), want)
            if data is None:
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

    def file_chunks(self, name: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
        """The bytes of ``name``, one of the manifest's files (its tokenizer's), in chunks;
        AdapterNotFound for any other name."""
        if self._closed:
            raise RuntimeError("stream lease already closed")
        if name not in {f.name for f in self.manifest.files}:
            listed = ", ".join(f.name for f in self.manifest.files) or "none"
            raise AdapterNotFound(f"adapter {self.manifest.name} has no file {name!r} (its files: "
                                  f"{listed})")
        return _file_chunks(self._staged.directory / name, chunk_bytes)

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._release()

    def __enter__(self) -> StreamLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _file_chunks(path: Path, chunk_bytes: int) -> Iterator[bytes]:
    with path.open("rb") as f:
        while data := f.read(chunk_bytes):
            yield data
