"""Noticing that an HTTP client went away, so its worker request is cancelled at once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request

from lorastream.gateway.errors import ClientGone

T = TypeVar("T")


async def wait_disconnected(request: Request) -> None:
    """Return when the client disconnects (call after the body was read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise
            except Exception:
                pass
    if task.cancelled():
        raise ClientGone("the client went away; the request was cancelled")
    return task.result()


@contextlib.asynccontextmanager
async def on_disconnect(request: Request, callback: Callable[[], None]) -> AsyncIterator[None]:
    """Call ``callback`` if the client disconnects while the block runs."""

    async def watch() -> None:
        await wait_disconnected(request)
        callback()

    watcher = asyncio.ensure_future(watch())
    try:
        yield
    finally:
        watcher.cancel()
