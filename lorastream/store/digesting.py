"""Hash an adapter's files while they download, so staging needs no second pass over them.

A source that writes each file front to back (S3 through s3transfer's in-order writer) writes it
through a :class:`DigestingWriter` of one :class:`StreamDigests`. The writer feeds the content id's
sha256 (``content_id`` in core/adapter_validation.py: each file as ``name \\0 size \\0`` then its
bytes, config first) and, once the weights file's safetensors header has arrived, each tensor's
sha256 and fast digest. Example, a header declaring two tensors at data offsets [0, 64) and
[64, 192) behind a 100-byte header: bytes 108..171 feed tensor 0, 172..299 tensor 1.

Nothing here validates: the stager validates the files afterwards as always and takes these
digests only for tensors whose (file offset, size) they cover; anything unexpected (a header too
large or unparsable, overlapping ranges, a file written out of order or not at all) only turns
the shortcut off, and the stager hashes from disk instead.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

from lorastream.core.adapter_format import WEIGHTS_FILE
from lorastream.core.adapter_validation import ALL_FILES, STAGED_FILES
from lorastream.core.checksum import Buffer, TensorDigests
from lorastream.store.writeback import Writeback


class StreamDigests:
    """The digests of one staging, fed file by file in :data:`ALL_FILES` order (STAGED_FILES,
    then the tokenizer's files present)."""

    def __init__(self, tensor_digest: str, max_header_bytes: int) -> None:
        self._fast = tensor_digest
        self._max_header = max_header_bytes
        self._content = hashlib.sha256()
        self._seen: list[str] = []  # the files written through, in order
        self._broken = False
        self._tensors: dict[int, tuple[int, TensorDigests]] = {}  # file offset -> (nbytes, digests)

    def writer(self, name: str, size: int, target: Path) -> DigestingWriter:
        """A writer of ``target`` (file ``name`` of ``size`` bytes, as listed by the source); the
        files must be written in ALL_FILES order, each to its end, one at a time."""
        last = ALL_FILES.index(self._seen[-1]) if self._seen else -1
        if name not in ALL_FILES or ALL_FILES.index(name) <= last:
            self._broken = True
        self._seen.append(name)
        self._content.update(f"{name}\0{size}\0".encode())
        return DigestingWriter(self, name, size, target)

    def _finished(self, name: str, written: int, size: int) -> None:
        if written != size:
            self._broken = True

    def _break(self) -> None:
        self._broken = True

    @property
    def content_id(self) -> str | None:
        """The content id of :attr:`files`, or None when they were not written as expected."""
        if self._broken or tuple(self._seen[:len(STAGED_FILES)]) != STAGED_FILES:
            return None
        return self._content.hexdigest()

    @property
    def files(self) -> tuple[str, ...]:
        """The files written through, in order (staging checks they are the adapter's all)."""
        return tuple(self._seen)

    @property
    def tensors(self) -> Mapping[int, tuple[int, TensorDigests]]:
        """file offset -> (nbytes, digests) of every tensor hashed completely; empty if broken."""
        return {} if self.content_id is None else self._tensors


class DigestingWriter:
    """A write-only file object: each ``write`` appends to ``target`` and feeds the digests.

    It reports itself not seekable, so s3transfer writes its parts in order (buffering at most
    its in-memory window) instead of seeking to each part's offset. A thread syncs the file to
    disk every few MB written (``writeback.py``).
    """

    def __init__(self, digests: StreamDigests, name: str, size: int, target: Path) -> None:
        self._digests = digests
        self._name = name
        self._size = size
        self._file: BinaryIO = target.open("wb")
        self._writeback = Writeback(self._file.fileno())  # the stager's fsync then waits for less
        self._written = 0
        self._head = bytearray() if name == WEIGHTS_FILE else None  # until the header is parsed
        self._ranges: list[tuple[int, int]] = []  # absolute [begin, end) of each tensor, in order
        self._current = 0  # index into _ranges of the first tensor not yet complete

    def seekable(self) -> bool:
        return False

    def write(self, data: Buffer) -> int:
        self._file.write(data)
        self._digests._content.update(data)
        if self._name == WEIGHTS_FILE:
            self._feed_tensors(memoryview(data).cast("B"), self._written)
        self._written += len(data)
        self._writeback.wrote(self._written)
        return len(data)

    def close(self) -> None:
        """Close the file; raises the error of a background sync (``writeback.py``)."""
        if self._file.closed:
            return
        try:
            self._file.flush()
            self._writeback.close()  # before the descriptor goes
        finally:
            self._file.close()
        self._digests._finished(self._name, self._written, self._size)

    # -- weights ------------------------------------------------------------------------------
    def _feed_tensors(self, data: memoryview, at: int) -> None:
        if self._head is not None:
            self._head += data
            if not self._parse_header():
                return
            data, at = memoryview(bytes(self._head)), 0  # the header and what followed it
            self._head = None
        end = at + len(data)
        while self._current < len(self._ranges) and at < end:
            begin, stop = self._ranges[self._current]
            if stop <= at:
                self._current += 1
                continue
            if begin >= end:
                return
            lo, hi = max(begin, at), min(stop, end)
            self._digests._tensors[begin][1].update(data[lo - at : hi - at])
            if hi == stop:
                self._current += 1
            else:
                return

    def _parse_header(self) -> bool:
        """Once the header is complete: the tensor ranges (True); False while it is not."""
        head = self._head
        assert head is not None
        if len(head) < 8:
            return False
        (length,) = struct.unpack("<Q", head[:8])
        if length > self._digests._max_header:
            self._give_up()
            return False
        if len(head) < 8 + length:
            return False
        try:
            header = json.loads(bytes(head[8 : 8 + length]))
            header.pop("__metadata__", None)
            spans = sorted((int(v["data_offsets"][0]), int(v["data_offsets"][1]))
                           for v in header.values())
        except (ValueError, TypeError, KeyError, AttributeError, IndexError):
            self._give_up()
            return False
        start = 8 + length
        previous_end = 0
        for begin, end in spans:
            if begin < previous_end or end < begin:  # overlapping: validation refuses it anyway
                self._give_up()
                return False
            previous_end = end
            self._ranges.append((start + begin, start + end))
            digests = TensorDigests(self._digests._fast)
            self._digests._tensors[start + begin] = (end - begin, digests)
        return True

    def _give_up(self) -> None:
        self._head = None
        self._ranges = []
        self._digests._break()

