"""Operator endpoints: preload, list, describe, delete adapters, and push them into workers.

All need ``Authorization: Bearer <token>`` with the operate token when the gateway has one
(lorastream/gateway/auth.py). Names may contain
``/`` (``support/en-v3``), hence the ``:path`` parameters.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from lorastream.core.errors import LorastreamError
from lorastream.core.generation import AdapterStatus
from lorastream.core.manifest import AdapterManifest, PreloadProgress, manifest_json
from lorastream.gateway.adapter_ops import forget, load_into, run_preload
from lorastream.gateway.auth import require_operator
from lorastream.gateway.catalog import residency_row, residency_summary, status_json
from lorastream.gateway.errors import UpstreamTimeout
from lorastream.gateway.http_errors import ApiError, api_error
from lorastream.gateway.listing import Page, store_pages, stream_list
from lorastream.gateway.openai_responses import SSE_DONE, sse
from lorastream.gateway.state import GatewayState, gateway_state

log = logging.getLogger(__name__)


router = APIRouter(prefix="/v1/adapters", dependencies=[Depends(require_operator)])


class PreloadBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, description="The name requests will use as `model`.")
    source: str = Field(min_length=1, description="s3://..., hf://org/repo[@rev], or /abs/path.")
    pin: bool = False
    force: bool = Field(False, description="Replace a name already staged from another source.")
    stream: bool = Field(False, description="Stream progress as server-sent events.")


class LoadBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    workers: list[str] | Literal["all"] | None = Field(
        None, description="Targets, 'all', or none for the adapter's routing choice."
    )
    pin: bool = False


@router.post("", status_code=201, response_model=None)
async def preload(body: PreloadBody, request: Request) -> Response | dict[str, Any]:
    """Fetch, verify and stage an adapter in the store."""
    state = gateway_state(request)
    if body.stream:
        return StreamingResponse(_preload_events(state, body), media_type="text/event-stream")
    try:
        manifest = await asyncio.wait_for(
            state.in_thread(run_preload, state, body.source, body.name, pin=body.pin,
                            force=body.force),
            state.settings.preload_timeout_s,
        )
    except TimeoutError as exc:
        raise UpstreamTimeout(
            f"the store did not finish preloading {body.name} within "
            f"{state.settings.preload_timeout_s:.0f} s; it may still complete: check "
            "GET /v1/adapters later"
        ) from exc
    return {"adapter": manifest_json(manifest)}


@router.get("")
async def list_adapters(request: Request) -> Response:
    """Every staged adapter in name order, where it resides on the workers (last poll), and the
    cache usage; streamed a store page at a time (gateway/listing.py)."""
    state = gateway_state(request)
    residency = residency_summary(list(state.pool.workers.values()))

    def items(page: list[AdapterManifest]) -> list[dict[str, Any]]:
        return [{**manifest_json(m), "workers": residency.get(m.name, {})} for m in page]

    def tail(page: Page) -> dict[str, Any]:
        return {"cache_bytes_used": page[1], "cache_bytes_budget": page[2]}

    return await stream_list([], store_pages(state), items, tail)


@router.post("/{name:path}/load")
async def load(name: str, request: Request, body: LoadBody | None = None) -> JSONResponse:
    """Push an adapter into workers: named ones, all healthy ones, or its routing choice."""
    state = gateway_state(request)
    body = body or LoadBody(workers=None)
    targets = _load_targets(state, name, body)
    results = await load_into(state, name, targets, body.pin)
    failures = [r for r in results if isinstance(r, LorastreamError)]
    if len(failures) == len(results):
        raise api_error(failures[0], "name")
    rows = [
        {"worker": t, "error": api_error(r).body()["error"]} if isinstance(r, LorastreamError)
        else {"worker": t, **status_json(r)}
        for t, r in zip(targets, results, strict=True)
    ]
    return JSONResponse({"adapter": name, "workers": rows})


@router.get("/{name:path}")
async def describe(name: str, request: Request) -> dict[str, Any]:
    """The adapter's manifest and its residency on every worker (asked live)."""
    state = gateway_state(request)
    manifest = await state.in_thread(state.store.describe, name)
    workers = list(state.pool.workers.values())

    async def adapters_of(target: str) -> list[AdapterStatus]:
        worker = state.pool.get(target)
        if not worker.healthy:
            return worker.adapters
        try:
            return (await worker.client.list_adapters())[0]
        except LorastreamError:
            return worker.adapters

    lists = await asyncio.gather(*(adapters_of(w.target) for w in workers))
    rows = [residency_row(w, name, adapters) for w, adapters in zip(workers, lists, strict=True)]
    return {"adapter": manifest_json(manifest), "workers": rows}


@router.delete("/{name:path}")
async def delete(name: str, request: Request) -> dict[str, Any]:
    """Forget the adapter in the store, then unload it from every worker that holds it."""
    forgotten = await forget(gateway_state(request), name)
    return {"deleted": name, "unloaded": forgotten.unloaded,
            "unload_errors": forgotten.unload_errors}


def _load_targets(state: GatewayState, name: str, body: LoadBody) -> list[str]:
    pool = state.pool
    if body.workers == "all":
        targets = [w.target for w in pool.workers.values() if w.healthy]
        if not targets:
            raise ApiError(503, "no worker is healthy", "service_unavailable",
                           code="no_healthy_worker")
        return targets
    if body.workers:
        unknown = [t for t in body.workers if t not in pool.workers]
        if unknown:
            raise ApiError(400, f"unknown workers {unknown}; the gateway knows "
                           f"{sorted(pool.workers)}", param="workers", code="invalid_value")
        return list(dict.fromkeys(body.workers))
    try:
        return [state.router.choose(name, pool.views()).target]
    except LorastreamError as exc:
        raise api_error(exc) from exc


async def _preload_events(state: GatewayState, body: PreloadBody) -> AsyncIterator[bytes]:
    """SSE progress of one preload: phase events, then the adapter, then ``[DONE]``."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[PreloadProgress] = asyncio.Queue()

    def push(event: PreloadProgress) -> None:
        loop.call_soon_threadsafe(events.put_nowait, event)

    task = asyncio.ensure_future(state.in_thread(
        run_preload, state, body.source, body.name, pin=body.pin, force=body.force,
        on_event=push,
    ))
    try:
        while not task.done() or not events.empty():
            getter = asyncio.ensure_future(events.get())
            await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                e = getter.result()
                yield sse({"phase": e.phase, "bytes_done": e.bytes_done,
                           "bytes_total": e.bytes_total, "message": e.message})
            else:
                getter.cancel()
        yield sse({"phase": "done", "adapter": manifest_json(task.result())})
    except LorastreamError as exc:
        yield sse(api_error(exc).body())
    yield SSE_DONE
