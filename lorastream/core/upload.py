"""An adapter upload as plain types: a header, then the files' bytes in chunks.

The client (``StoreClient.push``) turns a PEFT directory, or files held in memory, into
:func:`upload_items`; the codec carries them as ``UploadAdapterRequest`` messages; the store reads
them back as a source like any other (``lorastream.store.sources.upload``). An upload carries the
adapter's config and weights, and its tokenizer's files when it ships one. One example, an
adapter of a 700-byte config and 2.5 MiB of weights, in 1 MiB chunks::

    UploadHeader(name, pin, force,
                 files=(adapter_config.json 700, adapter_model.safetensors 2.5 MiB))
    UploadChunk(0, 0, 700 bytes)
    UploadChunk(1, 0, 1 MiB)  UploadChunk(1, 1 MiB, 1 MiB)  UploadChunk(1, 2 MiB, 0.5 MiB)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from lorastream.core.adapter_format import CONFIG_FILE, PICKLE_FILES, WEIGHTS_FILE
from lorastream.core.adapter_tokenizer import tokenizer_files
from lorastream.core.checksum import crc32c
from lorastream.core.errors import InvalidAdapter

PUSH_SCHEME = "push"
UPLOAD_CHUNK_BYTES = 1 << 20  # the store's servers take messages up to 16 MiB

# Called with (bytes sent so far, bytes in the whole upload).
SentCallback = Callable[[int, int], None]


def push_uri(name: str) -> str:
    """The source URI a pushed adapter is staged under (shown in its manifest)."""
    return f"{PUSH_SCHEME}://{name}"


@dataclass(frozen=True)
class UploadFile:
    """One file of an upload, as the header declares it."""

    path: str  # file name inside the adapter directory
    size: int  # exact bytes that follow for it


@dataclass(frozen=True)
class UploadHeader:
    """The first item of an upload: the name and the files that follow."""

    name: str
    pin: bool
    force: bool
    files: tuple[UploadFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class UploadChunk:
    """Bytes ``[offset, offset + len(data))`` of file ``file_index``."""

    file_index: int
    offset: int
    data: bytes | memoryview
    crc32c: int


UploadItem = UploadHeader | UploadChunk
# What a file of an upload is read from: a path (read in chunks) or bytes in memory.
FileContent = Path | bytes | bytearray | memoryview


def directory_files(directory: Path) -> list[tuple[str, FileContent]]:
    """The files of a PEFT LoRA directory to upload: its config and weights, and its tokenizer's
    if it ships one (``core/adapter_tokenizer.py``); InvalidAdapter naming what is missing."""
    if not directory.is_dir():
        raise InvalidAdapter(f"{directory} is not a directory; point at a PEFT LoRA directory")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (directory / name).is_file():
            pickles = [p for p in PICKLE_FILES if (directory / p).is_file()]
            hint = (
                f" (it holds only a pickle checkpoint, {', '.join(pickles)}: save with "
                "PeftModel.save_pretrained(dir, safe_serialization=True))"
                if pickles and name == WEIGHTS_FILE else ""
            )
            raise InvalidAdapter(
                f"{directory} has no {name}; expected a PEFT LoRA directory{hint}"
            )
    present = [p.name for p in directory.iterdir() if p.is_file()]
    return [(name, directory / name)
            for name in (CONFIG_FILE, WEIGHTS_FILE, *tokenizer_files(present))]


def _size(content: FileContent) -> int:
    return os.stat(content).st_size if isinstance(content, Path) else len(memoryview(content))


def _pieces(content: FileContent, chunk_bytes: int) -> Iterator[bytes | memoryview]:
    if isinstance(content, Path):
        with content.open("rb") as f:
            while piece := f.read(chunk_bytes):
                yield piece
        return
    view = memoryview(content).cast("B")
    for start in range(0, len(view), chunk_bytes):
        yield view[start : start + chunk_bytes]


def upload_items(
    name: str,
    files: Sequence[tuple[str, FileContent]],
    *,
    pin: bool = False,
    force: bool = False,
    chunk_bytes: int = UPLOAD_CHUNK_BYTES,
    on_sent: SentCallback | None = None,
) -> Iterator[UploadItem]:
    """The header, then every file's bytes in chunks of at most ``chunk_bytes``, CRC-32C each.

    Files given as paths are read as the upload goes (memory stays flat); a file that changes
    size meanwhile ends in an upload the store refuses.
    """
    header = UploadHeader(
        name, pin, force, tuple(UploadFile(path, _size(content)) for path, content in files)
    )
    yield header
    sent = 0
    for index, (_, content) in enumerate(files):
        offset = 0
        for piece in _pieces(content, chunk_bytes):
            yield UploadChunk(index, offset, piece, crc32c(piece))
            offset += len(piece)
            sent += len(piece)
            if on_sent is not None:
                on_sent(sent, header.total_bytes)
