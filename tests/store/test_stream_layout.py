"""The stream layout: tensors end to end, chunks split back into per-tensor pieces."""

from __future__ import annotations

import pytest

from lorastream.core.manifest import AdapterManifest, TensorInfo
from lorastream.core.stream_layout import StreamLayout


def _layout(*sizes: int) -> StreamLayout:
    tensors = tuple(
        TensorInfo(f"t{i}", "F32", (size // 4,), size, "") for i, size in enumerate(sizes)
    )
    return StreamLayout(
        AdapterManifest("id", "n", "", "", "", 1, 1.0, False, (), tensors)
    )


@pytest.mark.parametrize(
    ("sizes", "flat", "position"),
    [
        ((8, 0, 4), 0, (0, 0)),
        ((8, 0, 4), 7, (0, 7)),
        ((8, 0, 4), 8, (2, 0)),  # the empty tensor 1 is skipped
        ((8, 0, 4), 12, (3, 0)),  # the end
        ((0, 0, 4), 0, (2, 0)),
    ],
)
def test_flat_offsets_map_to_the_tensor_that_holds_them(
    sizes: tuple[int, ...], flat: int, position: tuple[int, int]
) -> None:
    layout = _layout(*sizes)
    assert layout.position(flat) == position
    assert layout.flat(*position) == flat


def test_a_chunk_splits_across_tensors_skipping_empty_ones() -> None:
    layout = _layout(8, 0, 4, 4)
    pieces = [(i, o, bytes(d)) for i, o, d in layout.split(0, 6, b"abcdefgh")]
    assert pieces == [(0, 6, b"ab"), (2, 0, b"cdef"), (3, 0, b"gh")]


def test_a_chunk_running_past_the_end_is_refused() -> None:
    with pytest.raises(ValueError, match="runs past"):
        list(_layout(4, 4).split(1, 2, b"abc"))
