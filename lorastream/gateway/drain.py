"""The gateway's graceful stop: readiness off, no new requests, open generations get a deadline.

On the first SIGINT/SIGTERM (``lorastream.gateway.server``) :meth:`Drain.run` starts:

1. ``/health`` answers 503 at once (the load balancer's readiness probe takes the gateway out)
   and every new ``/v1/*`` request gets 503 ``shutting_down`` with ``Retry-After``
   (``RefuseWhileDraining``);
2. the generations in flight go on for up to ``drain_seconds``;
3. each one still open then is cut: a stream gets an OpenAI-shaped error event
   (``{"error": {..., "type": "service_unavailable", "code": "shutting_down"}}``) and
   ``data: [DONE]``, a non-streamed request a 503 with that body; then the server stops.

A second signal during the drain (an impatient operator's Ctrl-C, a ``kill`` sent twice) ends
the drain period at once (:meth:`Drain.stop_now`): step 3 happens now, so the open streams still
end with the error event and ``[DONE]`` and the process exits 0 within ``CUT_GRACE_S`` plus
uvicorn's last-response wait, not ``drain_seconds`` later. A third signal is uvicorn's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

from starlette.types import ASGIApp, Receive, Scope, Send

from lorastream.gateway.http_errors import ApiError

log = logging.getLogger(__name__)

T = TypeVar("T")

# How long cut generations get to write their error event before the server stops anyway.
CUT_GRACE_S = 2.0


def shutting_down(message: str) -> ApiError:
    """The 503 of a request refused or cut because the gateway is stopping."""
    return ApiError(503, message, "service_unavailable", code="shutting_down")


class Drain:
    """Whether the gateway is draining, and the generations open now (each with its cut)."""

    def __init__(self) -> None:
        self.draining = False
        self._open: dict[int, Callable[[], None]] = {}
        self._next = 0
        self._idle: asyncio.Event | None = None  # made by run(), in the event loop
        self._stop_now = asyncio.Event()  # set by stop_now(): cut the open generations now

    @property
    def open_count(self) -> int:
        return len(self._open)

    @contextlib.contextmanager
    def track(self, cut: Callable[[], None]) -> Iterator[None]:
        """Count a generation as open while the block runs; ``cut()`` ends it if the drain
        deadline passes first (it must make the block end soon)."""
        key = self._next
        self._next += 1
        self._open[key] = cut
        try:
            yield
        finally:
            del self._open[key]
            if not self._open and self._idle is not None:
                self._idle.set()

    async def guard(self, work: Awaitable[T]) -> T:
        """Await ``work`` as an open generation; raise the 503 ``shutting_down`` ApiError if
        the drain cuts it."""
        task = asyncio.ensure_future(work)
        cut = False

        def cut_task() -> None:
            nonlocal cut
            cut = True
            task.cancel()

        with self.track(cut_task):
            try:
                return await task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if cut and not (current is not None and current.cancelling()):
                    raise shutting_down(
                        "the gateway is shutting down and its drain period ended before this "
                        "request finished; retry it"
                    ) from None
                raise

    def stop_now(self) -> None:
        """End the drain period at once (a second signal): :meth:`run` cuts what is open now.
        Call it in the event loop; before :meth:`run` has started, it makes run() cut at once."""
        self._stop_now.set()

    async def run(self, seconds: float) -> None:
        """Turn readiness off, wait up to ``seconds`` (or until :meth:`stop_now`) for the open
        generations to end, cut the rest and give them ``CUT_GRACE_S`` to write their error."""
        self.draining = True
        self._idle = asyncio.Event()
        if not self._open:
            self._idle.set()
        log.info("gateway draining: /health is 503, new requests are refused; waiting up to "
                 "%.0f s for %d open generation(s)", seconds, self.open_count)
        started = time.monotonic()
        waits = [asyncio.ensure_future(self._idle.wait()),
                 asyncio.ensure_future(self._stop_now.wait())]
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        if self._open:
            if self._stop_now.is_set():
                log.warning("second signal: ending %d open generation(s) now with a "
                            "shutting_down error", self.open_count)
            else:
                log.warning("drain period of %.0f s over: ending %d open generation(s) with a "
                            "shutting_down error", seconds, self.open_count)
            for cut in list(self._open.values()):
                cut()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), timeout=CUT_GRACE_S)
        else:
            log.info("drained in %.1f s", time.monotonic() - started)


class RefuseWhileDraining:
    """While the gateway drains, answer every ``/v1/*`` request with 503 ``shutting_down``,
    ``Retry-After`` and ``Connection: close`` (the client retries on another gateway)."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.drain.draining and scope["path"].startswith("/v1/"):
            response = shutting_down(
                "the gateway is shutting down and takes no new requests; retry on another "
                "gateway (Retry-After)"
            ).response()
            response.headers["Connection"] = "close"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
