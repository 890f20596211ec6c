"""Staging starts each written stride of a downloading file on its way to the disk
(``writeback.py``), so the fsync after the download waits only for the tail; the bytes written
are unchanged and a file system that refuses ``sync_file_range`` only turns it off."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lorastream.store import writeback
from lorastream.store.writeback import Writeback

pytestmark = pytest.mark.skipif(not writeback.available(), reason="no sync_file_range (not Linux)")


@pytest.mark.parametrize(
    ("pieces", "expected"),
    [
        ([10, 10, 10, 10], [(0, 16), (16, 16)]),  # every whole stride once, in order
        ([40], [(0, 32)]),  # one big write: its whole strides at once
        ([15, 1, 15], [(0, 16)]),  # 31 bytes: the partial stride waits for the fsync
        ([5], []),
    ],
)
def test_each_whole_stride_is_started_once_in_order(
    tmp_path: Path, pieces: list[int], expected: list[tuple[int, int]]
) -> None:
    data = os.urandom(sum(pieces))
    path = tmp_path / "f"
    with path.open("wb", buffering=0) as f:
        wb = Writeback(f.fileno(), stride=16)
        at = 0
        for n in pieces:
            f.write(data[at : at + n])
            at += n
            wb.wrote(at)
        os.fsync(f.fileno())
    assert wb.ranges == expected
    assert path.read_bytes() == data


def test_a_descriptor_it_cannot_write_back_turns_it_off(tmp_path: Path) -> None:
    wb = Writeback(-1, stride=16)  # sync_file_range fails with EBADF
    wb.wrote(64)
    wb.wrote(128)
    assert wb.ranges == []
