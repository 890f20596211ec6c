"""Staging has a thread sync each stride of a downloading file to disk (``writeback.py``), so the
fsync after the download waits only for the tail: writers never wait for it, every whole stride
is on disk once the writeback is closed, the bytes are unchanged, and a failed sync is raised
at close (Linux reports a writeback error once, so it must not be lost)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from lorastream.store import writeback
from lorastream.store.writeback import Writeback


@pytest.mark.parametrize(
    ("pieces", "synced"),
    [
        ([10, 10, 10, 10], 32),  # every whole stride
        ([40], 32),  # one big write
        ([15, 1, 15], 16),  # 31 bytes: the partial stride is left to the stager's fsync
        ([5], 0),  # no whole stride: no thread, no sync
    ],
)
def test_every_whole_stride_is_on_disk_after_close_and_the_bytes_are_unchanged(
    tmp_path: Path, pieces: list[int], synced: int
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
        wb.close()
        assert wb.synced == synced
        assert (wb.syncs > 0) == (synced > 0)
    assert path.read_bytes() == data


def test_writers_do_not_wait_for_a_slow_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()

    def slow_sync(fd: int) -> None:  # a disk that takes its time
        release.wait(5)
        os.fsync(fd)

    monkeypatch.setattr(writeback, "_datasync", slow_sync)
    with (tmp_path / "f").open("wb", buffering=0) as f:
        wb = Writeback(f.fileno(), stride=16)
        began = time.perf_counter()
        for i in range(1, 9):
            f.write(b"x" * 16)
            wb.wrote(16 * i)
        wrote_s = time.perf_counter() - began
        assert wb.synced == 0  # the first sync is still in progress
        release.set()
        wb.close()
    assert wrote_s < 1.0, f"8 writes took {wrote_s:.2f} s behind a stalled sync"
    assert wb.synced == 128 and wb.syncs <= 2  # requests made meanwhile are coalesced


def test_a_failed_sync_is_raised_at_close() -> None:
    read, write = os.pipe()  # fdatasync of a pipe fails (EINVAL)
    try:
        wb = Writeback(read, stride=16)
        wb.wrote(64)
        with pytest.raises(OSError):
            wb.close()
        assert wb.synced == 0
        wb.wrote(128)  # after a failure: no new sync
        assert wb.syncs == 0
    finally:
        os.close(read)
        os.close(write)
