"""The checksums of the tensor stream.

- **CRC-32C** (Castagnoli) of every chunk, on both ends: the ``crc32c`` package uses the
  SSE4.2/ARMv8 CRC instructions (several times ``zlib.crc32``'s rate; docs/notes/store.md,
  "Costs moved from the stream's comments"), takes
  any buffer (so a zero-copy view of a received chunk is checked in place) and releases the GIL on
  large inputs. It catches corruption in transit.
- **Per-tensor digests**, computed by the store once, at staging, from the staged file, and carried
  in the manifest: a receiver checks each landed tensor against them, which catches what a chunk
  CRC cannot (a chunk landed at the wrong offset, a resumed stream that skipped or repeated bytes,
  staged bytes that changed on the store's disk after staging). ``checksum`` is the tensor's
  sha256 (always there); ``fast_checksum`` is ``"<algorithm>:<hex>"`` in one of
  :data:`FAST_DIGESTS`, empty in manifests staged before it existed, which are verified with
  sha256. docs/store.md ("Verification") says why the default is xxh3-128 and what it protects
  against.
"""

from __future__ import annotations

import hashlib
from typing import Final, Protocol

import blake3
import xxhash
from crc32c import crc32c as _crc32c

Buffer = bytes | bytearray | memoryview

XXH3_128: Final = "xxh3-128"
BLAKE3: Final = "blake3"
SHA256: Final = "sha256"
FAST_DIGESTS = (XXH3_128, BLAKE3)  # what a manifest's fast_checksum may name
TENSOR_DIGESTS = (*FAST_DIGESTS, SHA256)  # what the store may stage with (sha256: no fast one)
DEFAULT_TENSOR_DIGEST: Final = XXH3_128  # measured: docs/BENCHMARKS.md, transfer section


def crc32c(data: Buffer) -> int:
    """CRC-32C of ``data`` as an unsigned 32-bit integer."""
    return _crc32c(data)


class _Hasher(Protocol):
    def update(self, data: Buffer, /) -> object: ...

    def hexdigest(self) -> str: ...


def new_hasher(algorithm: str) -> _Hasher:
    """An incremental hasher of ``algorithm`` (one of :data:`TENSOR_DIGESTS`); BLAKE3 runs on
    one thread: tensors are small (hundreds of KB) and its thread pool loses below a few MB."""
    if algorithm == XXH3_128:
        return xxhash.xxh3_128()
    if algorithm == BLAKE3:
        return blake3.blake3()
    if algorithm == SHA256:
        return hashlib.sha256()
    raise ValueError(f"unknown tensor digest {algorithm!r}: use one of {', '.join(TENSOR_DIGESTS)}")


class TensorDigests:
    """The sha256 and (unless ``fast`` is sha256) the fast digest of one tensor, fed in pieces:
    the store hashes each staged tensor in one read pass."""

    def __init__(self, fast: str) -> None:
        self._sha256 = hashlib.sha256()
        self._fast_name = fast
        self._fast = None if fast == SHA256 else new_hasher(fast)

    def update(self, data: Buffer) -> None:
        self._sha256.update(data)
        if self._fast is not None:
            self._fast.update(data)

    @property
    def sha256(self) -> str:
        return self._sha256.hexdigest()

    @property
    def fast_checksum(self) -> str:
        """``"<algorithm>:<hex>"``, or "" when the store stages with sha256 alone."""
        return "" if self._fast is None else f"{self._fast_name}:{self._fast.hexdigest()}"


def verify_tensor(data: Buffer, sha256: str, fast_checksum: str) -> tuple[bool, str]:
    """Check a landed tensor: (matches, algorithm used). The fast digest when the manifest
    carries one this build knows, else sha256 (always in the manifest)."""
    algorithm, _, expected = fast_checksum.partition(":")
    if algorithm not in FAST_DIGESTS:
        return hashlib.sha256(data).hexdigest() == sha256, SHA256
    hasher = new_hasher(algorithm)
    hasher.update(data)
    return hasher.hexdigest() == expected, algorithm
