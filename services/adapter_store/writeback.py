"""Start writing a file's dirty pages to disk while it is still being written.

Staging ends with an fsync of every staged file (``staging.py``: a registered adapter survives a
crash), and an fsync after the download waits for all of the file's bytes to reach the disk at
once: 0.15 s of a 78 MB adapter's 1.05 s preload from S3 in ``bench transfer``. A writer that
calls :meth:`Writeback.wrote` after each write has the kernel start writing each completed
``stride`` of the file (``sync_file_range(SYNC_FILE_RANGE_WRITE)``: asynchronous, it does not
wait for the disk) while the rest downloads, so the final fsync waits only for the tail. It
changes when bytes reach the disk, never whether: the fsync still follows.

``sync_file_range`` is Linux's; elsewhere (or if libc lacks it) :meth:`wrote` does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of dirty pages in the range, no wait
DEFAULT_STRIDE = 8 << 20


def _load_sync_file_range() -> "ctypes._NamedFuncPointer | None":
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


def available() -> bool:
    """Whether early writeback works here (Linux with ``sync_file_range``)."""
    return _sync_file_range is not None


class Writeback:
    """Early writeback of one file open for writing front to back (descriptor ``fd``)."""

    def __init__(self, fd: int, stride: int | None = None) -> None:
        self._fd = fd
        self._stride = DEFAULT_STRIDE if stride is None else stride
        self._started = 0  # bytes [0, _started) have had their writeback started
        self.ranges: list[tuple[int, int]] = []  # (offset, length) of each writeback started

    def wrote(self, end: int) -> None:
        """The file now holds bytes [0, ``end``): start writing back every whole stride."""
        if _sync_file_range is None or end - self._started < self._stride:
            return
        upto = end - end % self._stride
        if _sync_file_range(self._fd, self._started, upto - self._started,
                            SYNC_FILE_RANGE_WRITE) != 0:
            errno = ctypes.get_errno()
            log.debug("sync_file_range failed (errno %d): the final fsync writes it all", errno)
            self._stride = 1 << 62  # do not try again on this file
            return
        self.ranges.append((self._started, upto - self._started))
        self._started = upto
