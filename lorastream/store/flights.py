"""The adapter store's downloads in flight: one download per URI, shared by the preloads of it.

Owns ``uri -> SharedDownload`` for the downloads in progress. The first preload of a URI starts
one (:meth:`DownloadsInFlight.join_or_start` says it owns it) and runs it
(:meth:`DownloadsInFlight.fly`); preloads of the same URI that come meanwhile join it: they see
its progress events and wait for its result. At commit the flight is claimed: it leaves the
table, so no preload joins it from then on, and the staged content comes back holding one lease
per participant (each registers its name, then releases its lease). A failed download leaves the
table too, and every participant raises its error.

Locking: one ``threading.RLock``, the store's, passed in; it guards this table together with the
registry and the staged contents (``staged_contents.py``). Call
:meth:`DownloadsInFlight.join_or_start` with it held and :meth:`DownloadsInFlight.fly` without
it: the download runs unlocked, the claim runs under it at commit
(:meth:`~lorastream.store.staged_contents.StagedContents.stage` takes it), and a failure takes
it to clean up.
"""

from __future__ import annotations

import logging
import threading

from lorastream.store.sources.base import AdapterSource
from lorastream.store.staged_contents import StagedContents
from lorastream.store.staging import SharedDownload

__all__ = ["DownloadsInFlight"]

log = logging.getLogger(__name__)


class DownloadsInFlight:
    """The downloads in progress by URI, each shared by every preload of its URI meanwhile."""

    def __init__(self, contents: StagedContents, lock: threading.RLock) -> None:
        self._contents = contents
        self._lock = lock
        self._flights: dict[str, SharedDownload] = {}  # uri -> download in progress

    def join_or_start(self, uri: str, name: str) -> tuple[SharedDownload, bool]:
        """The download of ``uri`` in progress (joined), or a new one; True when new (lock
        held)."""
        flight = self._flights.get(uri)
        if flight is None:
            flight = self._flights[uri] = SharedDownload(uri)
            return flight, True
        flight.participants += 1
        log.info("preload of %s joins the download of %s in progress", name, uri)
        return flight, False

    def fly(self, flight: SharedDownload, source: AdapterSource) -> None:
        """Run ``flight``'s download to the end (unlocked); sets its result or error."""
        try:
            flight.on_phase("resolving", 0, 0)
            resolved = source.resolve(flight.uri)

            def claim() -> int:
                # Under the lock, at commit: no preload joins from now on; each participant
                # registers its name, then releases the lease taken for it here.
                del self._flights[flight.uri]
                return flight.participants

            staged = self._contents.stage(source, resolved, flight.on_phase, claim)
            flight.result = (staged, resolved.revision)
        except BaseException as err:
            with self._lock:
                if self._flights.get(flight.uri) is flight:
                    del self._flights[flight.uri]
            flight.error = err
            log.warning("preload of %s failed: %s", flight.uri, err)
        finally:
            flight.finished.set()
