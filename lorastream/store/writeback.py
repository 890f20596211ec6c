"""Make a downloading file durable as it is written, so the fsync after the download is short.

Staging ends with an fsync of every staged file (``staging.py``: a registered adapter survives a
crash). Left to the end, that fsync waits for the whole file and its block allocations to reach
the disk, a noticeable part of a preload from S3. A writer that
reports its progress to a :class:`Writeback` has a thread of its own ``fdatasync`` the file
after every ``stride`` bytes while the rest downloads; the final fsync then waits for the tail.
``fdatasync`` on the writing thread would slow the download; ``sync_file_range`` alone is not
enough (measured: docs/notes/store.md, "Writeback during S3 downloads").

(``sync_file_range`` writes the pages but commits no metadata: the fsync still waited for the
journal.) It changes when bytes reach the disk, never whether: the stager's fsync still
follows. An error of a background ``fdatasync`` is kept and raised by :meth:`Writeback.close`:
Linux reports a writeback error once per open file, so a later fsync might not see it again.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

DEFAULT_STRIDE = 4 << 20
_datasync = getattr(os, "fdatasync", os.fsync)  # fdatasync is not on every platform


class Writeback:
    """Background ``fdatasync`` of one file written front to back (descriptor ``fd``), every
    ``stride`` bytes. :meth:`close` before the descriptor closes."""

    def __init__(self, fd: int, stride: int | None = None) -> None:
        self._fd = fd
        self._stride = DEFAULT_STRIDE if stride is None else stride
        self._cond = threading.Condition()
        self._requested = 0  # sync the file up to here (a multiple of the stride)
        self._synced = 0  # the file is durable up to here
        self._error: Exception | None = None
        self._closing = False
        self._thread: threading.Thread | None = None  # started at the first whole stride
        self.syncs = 0  # fdatasync calls made (tests, logs)

    @property
    def synced(self) -> int:
        """Bytes [0, synced) are on disk."""
        with self._cond:
            return self._synced

    def wrote(self, end: int) -> None:
        """The file now holds bytes [0, ``end``); returns at once."""
        upto = end - end % self._stride
        with self._cond:
            if upto <= self._requested or self._error is not None:
                return
            self._requested = upto
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="writeback", daemon=True)
                self._thread.start()
            self._cond.notify()

    def close(self) -> None:
        """Wait for the sync in progress and the one requested, stop; raise a sync's error."""
        with self._cond:
            self._closing = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._requested <= self._synced and not self._closing:
                    self._cond.wait()
                if self._requested <= self._synced:  # closing, nothing left
                    return
                target = self._requested
            try:
                _datasync(self._fd)
            except Exception as err:
                log.warning("background fdatasync failed: %s", err)
                with self._cond:
                    self._error = err
                return
            with self._cond:
                self._synced = target
                self.syncs += 1
