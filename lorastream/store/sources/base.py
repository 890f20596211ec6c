"""The one interface every adapter source implements (S3, the Hugging Face Hub, local paths).

A source turns a URI into a :class:`ResolvedSource` (a pinned revision and the files to fetch),
then downloads those files into a directory the stager owns. Sources know nothing about
validation, manifests or the cache: the stager does that.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lorastream.core.adapter_format import CONFIG_FILE, PICKLE_FILES, WEIGHTS_FILE
from lorastream.core.adapter_tokenizer import tokenizer_files
from lorastream.core.errors import InvalidAdapter
from lorastream.store.digesting import StreamDigests

# Called with the number of bytes just written; must be cheap and thread-safe.
ProgressCallback = Callable[[int], None]


@dataclass(frozen=True)
class RemoteFile:
    """One file of an adapter as the source lists it."""

    path: str  # relative path inside the adapter, e.g. "adapter_model.safetensors"
    size: int  # bytes, or -1 when the source cannot tell before downloading


@dataclass(frozen=True)
class ResolvedSource:
    """A URI pinned to a revision, with the files that make up the adapter."""

    uri: str
    revision: str  # Hub commit sha, S3 ETag of the weights, or "" for local files
    files: tuple[RemoteFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(max(f.size, 0) for f in self.files)


class AdapterSource(abc.ABC):
    """Fetches PEFT adapter directories from one kind of location."""

    #: URI schemes this source handles, e.g. ("s3",).
    schemes: tuple[str, ...] = ()

    @abc.abstractmethod
    def resolve(self, uri: str) -> ResolvedSource:
        """Pin ``uri`` to a revision and list the adapter's files.

        Raises AdapterNotFound (missing bucket/key/repo/path), InvalidArgument (malformed URI,
        path traversal), InvalidAdapter (pickle-only checkpoint, no config) or SourceUnavailable.
        """

    @abc.abstractmethod
    def download(self, resolved: ResolvedSource, dest: Path, progress: ProgressCallback) -> None:
        """Write every file of ``resolved`` into the existing directory ``dest``."""

    def download_digested(
        self,
        resolved: ResolvedSource,
        dest: Path,
        progress: ProgressCallback,
        digests: StreamDigests,
    ) -> None:
        """As :meth:`download`; a source that can write each file front to back writes it
        through ``digests`` (store/digesting.py), so staging does not read it again to hash it.
        By default the files are downloaded as usual and ``digests`` stays empty."""
        self.download(resolved, dest, progress)


def select_adapter_files(listing: dict[str, int], uri: str) -> tuple[RemoteFile, ...]:
    """Pick the files lorastream needs from a source's listing (relative path -> size): the
    adapter's config and weights, and its tokenizer's files if it ships them.

    Refuses pickle-only checkpoints without ever fetching them, and names what is missing.
    """
    if WEIGHTS_FILE not in listing:
        pickles = [p for p in PICKLE_FILES if p in listing]
        if pickles:
            raise InvalidAdapter(
                f"{uri} holds only a pickle checkpoint ({', '.join(pickles)}); lorastream never "
                f"unpickles weights. Convert it to {WEIGHTS_FILE} (e.g. PeftModel.save_pretrained("
                "dir, safe_serialization=True)) and upload that."
            )
        raise InvalidAdapter(f"{uri} has no {WEIGHTS_FILE}; expected a PEFT LoRA directory.")
    if CONFIG_FILE not in listing:
        raise InvalidAdapter(f"{uri} has no {CONFIG_FILE}; expected a PEFT LoRA directory.")
    names = (CONFIG_FILE, WEIGHTS_FILE, *tokenizer_files(list(listing)))
    return tuple(RemoteFile(p, listing[p]) for p in names)
