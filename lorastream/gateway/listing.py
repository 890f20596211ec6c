"""Lists that grow with the number of adapters (``GET /v1/models``, ``GET /v1/adapters``), sent a
store page at a time.

A store may hold 100,000 names: one JSON body built in memory would be ~40 MB. So a full list is
streamed: the gateway asks the store for one ``ListAdapters`` page (at most 1,000 names, in name
order), writes its items and asks for the next, holding one page at a time. The body is the same
JSON object a client always got. Clients that want pages ask with OpenAI's list cursor instead:
``?limit=N`` (1-1000) and ``?after=ID`` (the ``last_id`` of the page before), answered with
``has_more``, ``first_id`` and ``last_id``.

The first page is fetched before the response starts, so a dead store is an HTTP error, not a
truncated body.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

from fastapi.responses import StreamingResponse

from lorastream.core.manifest import AdapterManifest
from lorastream.gateway.state import GatewayState

MAX_LIMIT = 1000  # the largest page a cursor request may ask for (the store's own page size)

Page = tuple[list[AdapterManifest], int, int]  # (manifests in name order, cache used, budget)


async def store_pages(state: GatewayState, after: str = "", page_size: int = 0
                      ) -> AsyncIterator[Page]:
    """The store's adapters a page at a time, in name order, from the name after ``after``; each
    page is fetched off the event loop."""
    pages: Iterator[Page] = state.store.pages(page_size=page_size, page_token=after)
    while (page := await state.in_thread(next, pages, None)) is not None:
        yield page


async def stream_list(
    head: Iterable[dict[str, Any]],
    pages: AsyncIterator[Page],
    items: Callable[[list[AdapterManifest]], Iterable[dict[str, Any]]],
    tail: Callable[[Page], dict[str, Any]] | None = None,
) -> StreamingResponse:
    """``{"object": "list", "data": [*head, *items(page) for each page], **tail(last page)}``,
    written page by page."""
    first = await anext(pages, None)  # before the response starts: a store error is an error

    async def body() -> AsyncIterator[bytes]:
        yield b'{"object": "list", "data": ['
        sep = b""
        last = first
        for item in head:
            yield sep + json.dumps(item).encode()
            sep = b", "
        page = first
        while page is not None:
            last = page
            for item in items(page[0]):
                yield sep + json.dumps(item).encode()
                sep = b", "
            page = await anext(pages, None)
        extra = tail(last) if tail is not None and last is not None else {}
        yield b"]" + b"".join(f", {json.dumps(k)}: {json.dumps(v)}".encode()
                              for k, v in extra.items()) + b"}"

    return StreamingResponse(body(), media_type="application/json")


async def cursor_page(
    head: list[dict[str, Any]],
    pages: AsyncIterator[Page],
    items: Callable[[list[AdapterManifest]], Iterable[dict[str, Any]]],
    limit: int,
) -> dict[str, Any]:
    """One page of at most ``limit`` items (``head`` first), in OpenAI's list shape."""
    data = list(head)
    async for page, _, _ in pages:
        data += items(page)
        if len(data) > limit:
            break
    has_more, data = len(data) > limit, data[:limit]
    return {"object": "list", "data": data, "has_more": has_more,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}

