"""How ``StreamAdapterTensors`` lays an adapter's tensors out: end to end, in manifest order.

A chunk starts at byte ``offset`` of tensor ``tensor_index`` and runs on through the following
tensors, so chunks are full-sized however small the tensors are (a rank-16 adapter has hundreds
of tensors of tens of KB; one message per tensor would cost gRPC more than the bytes). Example:
tensors of 10, 0 and 4 bytes with ``chunk_bytes=8``, from the start::

    flat bytes:  [t0: 0..10)[t2: 10..14)        (t1 is empty)
    chunks:      (0, 0, 8 bytes) (0, 8, 6 bytes)  -> pieces t0[8:10], t2[0:4]

A resume point is a (tensor, offset) inside the adapter; the end is (len(tensors), 0).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from itertools import accumulate

from lorastream.core.manifest import AdapterManifest


class StreamLayout:
    """The tensors of one manifest laid end to end."""

    def __init__(self, manifest: AdapterManifest) -> None:
        self.sizes = [t.nbytes for t in manifest.tensors]
        self.starts = [0, *accumulate(self.sizes)][:-1]  # flat offset of each tensor
        self.total = sum(self.sizes)
        # Non-empty tensors only, for mapping a flat offset back to its tensor.
        self._nonempty = [i for i, size in enumerate(self.sizes) if size]
        self._nonempty_starts = [self.starts[i] for i in self._nonempty]

    @property
    def count(self) -> int:
        return len(self.sizes)

    def flat(self, tensor_index: int, offset: int) -> int:
        """Flat offset of byte ``offset`` of tensor ``tensor_index`` (the end for ``count``)."""
        return self.total if tensor_index == self.count else self.starts[tensor_index] + offset

    def position(self, flat: int) -> tuple[int, int]:
        """The (tensor, offset) of flat byte ``flat``, skipping empty tensors; the end at total."""
        if flat >= self.total:
            return self.count, 0
        k = bisect.bisect_right(self._nonempty_starts, flat) - 1
        index = self._nonempty[k]
        return index, flat - self.starts[index]

    def split(
        self, tensor_index: int, offset: int, data: bytes | memoryview
    ) -> Iterator[tuple[int, int, memoryview]]:
        """The (tensor, offset, bytes) pieces of a chunk that starts at (tensor_index, offset).

        Raises ValueError when the chunk runs past the last tensor.
        """
        view = memoryview(data)
        if self.flat(tensor_index, offset) + len(view) > self.total:
            raise ValueError(
                f"chunk at tensor {tensor_index} offset {offset} of {len(view)} bytes runs past "
                f"the adapter's {self.total} bytes"
            )
        index = tensor_index
        while len(view):
            take = min(self.sizes[index] - offset, len(view))
            if take > 0:
                yield index, offset, view[:take]
                view = view[take:]
            index, offset = index + 1, 0
