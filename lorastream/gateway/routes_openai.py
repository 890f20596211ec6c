"""The OpenAI-compatible endpoints: completions, chat completions, models."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lorastream.core.adapter_mix import MIX_PREFIX
from lorastream.core.errors import AdapterNotFound, LorastreamError
from lorastream.core.manifest import AdapterManifest
from lorastream.gateway.auth import is_operator, require_api_key
from lorastream.gateway.catalog import (
    adapter_model_object,
    base_model_object,
    base_of,
    served_adapters,
)
from lorastream.gateway.client_watch import on_disconnect, unless_disconnected
from lorastream.gateway.dispatch import Generation
from lorastream.gateway.drain import Drain, shutting_down
from lorastream.gateway.errors import ClientGone
from lorastream.gateway.http_errors import ApiError, api_error
from lorastream.gateway.listing import MAX_LIMIT, cursor_page, store_pages, stream_list
from lorastream.gateway.lorax import check_adapter_source
from lorastream.gateway.openai_responses import (
    SSE_DONE,
    Completed,
    ResponseBuilder,
    sse,
)
from lorastream.gateway.openai_schemas import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
)
from lorastream.gateway.state import gateway_state

log = logging.getLogger(__name__)

router = APIRouter(dependencies=[Depends(require_api_key)])

# Sampling parameters are range-checked here before any worker sees them; the vocabulary is the
# worker's business (stop_token_ids beyond it are refused there).
_ANY_VOCAB = 2**31 - 1
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    """Text completion of ``prompt`` with the adapter (or base model) named by ``model``."""
    return await _generate(request, body, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    """Chat completion: the worker renders ``messages`` with the model's chat template."""
    return await _generate(request, body, chat=True)


@router.get("/v1/models", response_model=None)
async def list_models(
    request: Request,
    limit: Annotated[int | None, Query(ge=1, le=MAX_LIMIT)] = None,
    after: str | None = None,
) -> Response | dict[str, Any]:
    """The base model and every adapter in the store that fits the base the workers serve (the
    store may hold other bases' adapters), with the adapter's metadata (its source only to the
    operate token) and its base as ``parent``. Streamed a store page at a time; ``limit`` and
    ``after`` ask for one page instead (gateway/listing.py)."""
    state = gateway_state(request)
    base = state.pool.base_model
    bases = state.pool.bases()
    operator = is_operator(request)

    def items(page: list[AdapterManifest]) -> list[dict[str, Any]]:
        return [adapter_model_object(m, parent, operator)
                for m, parent in served_adapters(page, bases, base)]

    head = [base_model_object(base, state.started_at)] if base and after is None else []
    start = "" if after is None or after == base else after
    if limit is None and after is None:
        return await stream_list(head, store_pages(state), items)
    page_size = min((limit or MAX_LIMIT) + 1, MAX_LIMIT)
    return await cursor_page(head, store_pages(state, start, page_size), items,
                             limit or MAX_LIMIT)


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> dict[str, Any]:
    """One model of the list: 404 for an adapter that is not in the store, or that is but fits
    no base the workers serve (saying why)."""
    state = gateway_state(request)
    base = state.pool.base_model
    if model == base:
        return base_model_object(base, state.started_at)
    try:
        manifest = await state.in_thread(state.store.describe, model)
    except AdapterNotFound as exc:
        raise ApiError(404, f"the model {model!r} does not exist: {exc}", param="model",
                       code="model_not_found") from exc
    parent, why_not = base_of(manifest, state.pool.bases(), base)
    if why_not is not None:
        raise ApiError(404, f"the model {model!r} is an adapter trained for a different base "
                       f"model than the workers serve: {why_not}", param="model",
                       code="model_not_found")
    return adapter_model_object(manifest, parent, is_operator(request))


async def _generate(
    request: Request, body: CompletionRequest | ChatCompletionRequest, chat: bool
) -> Response:
    state = gateway_state(request)
    arrived_at = time.perf_counter()
    prompt_param = "messages" if chat else "prompt"
    try:
        model = body.target(state.pool.base_model)
    except LorastreamError as exc:
        raise ApiError(400, str(exc), param=body.model_param, code="invalid_value") from exc
    if body.adapter_source is not None:
        await check_adapter_source(state, model, body.adapter_id, body.adapter_source)
    tools = isinstance(body, ChatCompletionRequest) and body.tool_use.parses
    builder = ResponseBuilder(model, chat, logprobs=body.top_logprobs_count() is not None,
                              tools=tools)
    headers = {"x-request-id": builder.id}
    try:
        params = body.sampling(0 if chat else COMPLETIONS_DEFAULT_MAX_TOKENS)
        # max_tokens 0 means "the worker's default" (sent unset on the wire): check the rest.
        unset = max(1, params.min_tokens)
        dataclasses.replace(params, max_tokens=params.max_tokens or unset).validate(_ANY_VOCAB)
        start = state.dispatcher.start(model, body.prompt_input(), params, builder.id, arrived_at)
        if not body.stream:
            done = await unless_disconnected(request, state.drain.guard(_collect(start)))
            return JSONResponse(builder.response(done), headers=headers)
        generation = await unless_disconnected(request, state.drain.guard(start))
    except LorastreamError as exc:
        error = api_error(exc, prompt_param)
        if error.status == 404 or (error.param is None and model.startswith(MIX_PREFIX)):
            error.param = body.model_param  # an unknown adapter, or a mix the worker refused
        raise error from exc
    return StreamingResponse(
        _stream(request, generation, builder, body.include_usage, state.drain, body.n),
        media_type="text/event-stream",
        headers={**_SSE_HEADERS, **headers},
    )


async def _collect(start: Awaitable[Generation]) -> Completed:
    generation = await start
    done = Completed()
    async for event in generation.events():
        done.add(event)
    return done


async def _stream(
    request: Request, generation: Generation, builder: ResponseBuilder, include_usage: bool,
    drain: Drain, choices: int = 1,
) -> AsyncIterator[bytes]:
    """SSE body: chunks as tokens arrive, then usage (if asked) and ``[DONE]``.

    An error after the first token can no longer change the status code: it is sent as an
    ``{"error": ...}`` event, which OpenAI's clients raise as an APIError, then ``[DONE]`` (a
    stream always ends with it, as vLLM's do: clients that read up to ``[DONE]`` would otherwise
    see a cut connection). A stream still open when the gateway's drain period ends gets a
    ``shutting_down`` error event, then ``[DONE]``.
    """
    done = Completed()
    cut = False

    def cut_stream() -> None:
        nonlocal cut
        cut = True
        generation.cancel()

    try:
        async with on_disconnect(request, generation.cancel):
            with drain.track(cut_stream):
                if builder.chat:
                    for index in range(choices):
                        yield sse(builder.role_chunk(index))
                async for event in generation.events():
                    done.add(event)
                    chunk = builder.delta_chunk(event)
                    if chunk is not None:
                        yield sse(chunk)
        if include_usage:
            yield sse(builder.usage_chunk(done.prompt_tokens, done.completion_tokens))
        yield SSE_DONE
    except ClientGone:
        if not cut:
            log.info("request %s: client went away; cancelled on %s", builder.id,
                     generation.target)
            return
        log.info("request %s: cut on %s at the end of the drain period", builder.id,
                 generation.target)
        yield sse(shutting_down(
            "the gateway is shutting down and its drain period ended before this stream "
            "finished; retry the request"
        ).body())
        yield SSE_DONE
    except LorastreamError as exc:
        log.warning("request %s failed mid-stream on %s: %s", builder.id, generation.target, exc)
        yield sse(api_error(exc).body())
        yield SSE_DONE
    finally:
        await generation.aclose()
