"""vLLM's own endpoints, for tooling written against vLLM's OpenAI server.

- ``POST /v1/load_lora_adapter`` ``{lora_name, lora_path}`` (operate token): stage the adapter
  in the store from ``lora_path`` (a path under the store's ``--allowed-local-root``,
  ``s3://...`` or ``hf://org/repo[@rev]``) and load it into a worker, which checks it against the
  base model; it is then listed in ``/v1/models`` and served. Either both happen or neither (a
  worker refusing the adapter un-stages it).
- ``POST /v1/unload_lora_adapter`` ``{lora_name}`` (operate token): forget it in the store and
  unload it from the workers; requests naming it get 404 from then on.
- ``POST /tokenize`` and ``POST /detokenize`` (also under ``/v1/``; an API key, like
  generation): with ``model`` an adapter's name, that adapter's own tokenizer if it ships one
  (its added tokens), else the base model's; an unknown ``model`` is 404, as for generation.

Success bodies, status codes and messages follow vLLM (``serving_models.py``: a plain-text
``Success: ...`` with 200; 400 for a name already loaded, 404 for one that cannot be found);
errors carry the gateway's OpenAI error body, which names the ``param``. A read-only API key is
refused the operate endpoints with 403, no token or a wrong one with 401.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from lorastream.core.errors import (
    AdapterNotFound,
    AlreadyExists,
    InvalidAdapter,
    InvalidArgument,
    LorastreamError,
)
from lorastream.core.generation import PromptInput
from lorastream.core.tokenization import TokenizeInput
from lorastream.gateway.adapter_ops import forget, load_into, run_preload
from lorastream.gateway.async_worker_client import AsyncWorkerClient
from lorastream.gateway.auth import require_api_key, require_operate_scope
from lorastream.gateway.errors import NoHealthyWorker, UpstreamTimeout
from lorastream.gateway.http_errors import ApiError, api_error
from lorastream.gateway.openai_schemas import ChatMessage, TokenId, chat_prompt
from lorastream.gateway.state import GatewayState, gateway_state

log = logging.getLogger(__name__)

operate_router = APIRouter(dependencies=[Depends(require_operate_scope)])
read_router = APIRouter(dependencies=[Depends(require_api_key)])


class LoadLoRAAdapterBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, description="The name requests will use as `model`.")
    lora_path: str = Field(
        min_length=1, description="A local path (under the store's --allowed-local-root), "
        "s3://bucket/prefix or hf://org/repo[@rev].",
    )
    load_inplace: StrictBool = Field(
        False, description="Replace the weights of a name already loaded (vLLM's flag)."
    )


class UnloadLoRAAdapterBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None

    @field_validator("lora_int_id")
    @classmethod
    def _no_int_id(cls, value: int | None) -> int | None:
        if value is not None:
            raise ValueError("this server names adapters and has no integer ids; send lora_name")
        return value


class _TokenizerRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, min_length=1, description="Default: the base model.")


class TokenizeBody(_TokenizerRequest):
    """vLLM's TokenizeCompletionRequest (``prompt``) or TokenizeChatRequest (``messages``)."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool | None = Field(
        None, description="Default: true for a prompt, false for messages (as vLLM)."
    )
    return_token_strs: StrictBool = False
    continue_final_message: StrictBool = False

    @field_validator("continue_final_message")
    @classmethod
    def _no_continue(cls, value: bool) -> bool:
        if value:
            raise ValueError("continue_final_message is not supported; leave it unset")
        return value

    @field_validator("messages")
    @classmethod
    def _text_only(cls, value: list[ChatMessage] | None) -> list[ChatMessage] | None:
        for message in value or ():
            message.text()  # raises on non-text parts
        return value

    def tokenize_input(self) -> TokenizeInput:
        if (self.prompt is None) == (self.messages is None):
            raise ApiError(400, "send either prompt or messages", param="prompt",
                           code="invalid_value")
        if self.messages is not None:
            prompt = chat_prompt(self.messages)  # as chat completions render them
        else:
            prompt = PromptInput(text=self.prompt)
        special = self.add_special_tokens
        if special is None:
            special = self.messages is None
        return TokenizeInput(prompt, self.add_generation_prompt, special, self.return_token_strs,
                             self.model or "")


class DetokenizeBody(_TokenizerRequest):
    tokens: list[TokenId]


@operate_router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoRAAdapterBody, request: Request) -> PlainTextResponse:
    """Stage ``lora_path`` as ``lora_name`` and load it into a worker."""
    state = gateway_state(request)
    name = body.lora_name
    if name == state.pool.base_model:
        raise ApiError(400, f"'{name}' is the base model's name; choose another lora_name",
                       param="lora_name", code="invalid_value")
    if not body.load_inplace and await _staged(state, name):
        raise ApiError(400, f"The lora adapter '{name}' has already been loaded. Unload it "
                       "first, or send load_inplace: true to replace its weights.",
                       param="lora_name", code="already_loaded")
    try:
        await asyncio.wait_for(
            state.in_thread(run_preload, state, body.lora_path, name, force=body.load_inplace),
            state.settings.preload_timeout_s,
        )
    except TimeoutError as exc:
        raise UpstreamTimeout(
            f"the store did not finish fetching {body.lora_path} within "
            f"{state.settings.preload_timeout_s:.0f} s; it may still complete: check "
            "GET /v1/models later"
        ) from exc
    except LorastreamError as exc:
        raise _source_error(exc) from exc
    await _load_or_unstage(state, name)
    log.info("vLLM load_lora_adapter: %s from %s", name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@operate_router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoRAAdapterBody, request: Request) -> PlainTextResponse:
    """Forget ``lora_name`` in the store and unload it from the workers."""
    state = gateway_state(request)
    name = body.lora_name
    try:
        forgotten = await forget(state, name)
    except AdapterNotFound as exc:
        raise ApiError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                       code="model_not_found") from exc
    if forgotten.unload_errors:  # the store no longer names it: no worker will serve it
        log.warning("unloaded %s from the store; workers that failed to drop their copy: %s",
                    name, forgotten.unload_errors)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


@read_router.post("/tokenize")
@read_router.post("/v1/tokenize")
async def tokenize(body: TokenizeBody, request: Request) -> dict[str, Any]:
    """vLLM's ``/tokenize``: ``{tokens, count, max_model_len}`` (and ``token_strs`` if asked)."""
    state = gateway_state(request)
    tokenize_input = body.tokenize_input()
    client = await _tokenizer_worker(state, body.model)
    try:
        tokenized = await client.tokenize(tokenize_input)
    except LorastreamError as exc:
        param = "messages" if body.messages is not None else "prompt"
        raise _param(api_error(exc), param) from exc
    return {"count": len(tokenized.tokens), "max_model_len": tokenized.max_model_len,
            "tokens": list(tokenized.tokens),
            "token_strs": list(tokenized.token_strs) if tokenized.token_strs is not None
            else None}


@read_router.post("/detokenize")
@read_router.post("/v1/detokenize")
async def detokenize(body: DetokenizeBody, request: Request) -> dict[str, str]:
    """vLLM's ``/detokenize``: ``{prompt}``."""
    state = gateway_state(request)
    client = await _tokenizer_worker(state, body.model)
    try:
        return {"prompt": await client.detokenize(body.tokens, body.model or "")}
    except LorastreamError as exc:
        raise _param(api_error(exc), "tokens") from exc


async def _staged(state: GatewayState, name: str) -> bool:
    try:
        await state.in_thread(state.store.describe, name)
    except AdapterNotFound:
        return False
    return True


async def _load_or_unstage(state: GatewayState, name: str) -> None:
    """Load ``name`` into its routing choice; on failure un-stage it and raise the error."""
    try:
        target = state.router.choose(name, state.pool.views()).target
        (result,) = await load_into(state, name, [target], pin=False)
    except LorastreamError as exc:
        result = exc
    if not isinstance(result, LorastreamError):
        return
    try:
        await forget(state, name)
    except LorastreamError as exc:
        log.warning("could not un-stage %s after its load failed: %s", name, exc)
    raise _param(api_error(result), "lora_path") from result


def _source_error(exc: LorastreamError) -> ApiError:
    """A preload error as vLLM words it: 404 when the source has no adapter, else 400."""
    if isinstance(exc, AlreadyExists):
        return ApiError(400, str(exc), param="lora_name", code="already_loaded")
    error = api_error(exc)
    if isinstance(exc, AdapterNotFound):
        error.message = f"No adapter found for {exc}"
    if isinstance(exc, (AdapterNotFound, InvalidArgument, InvalidAdapter)):
        error.param = "lora_path"
    return error


def _param(error: ApiError, param: str) -> ApiError:
    """``error`` naming ``param`` when it is the client's (a 4xx) and names nothing yet."""
    if 400 <= error.status < 500 and error.param is None:
        error.param = param
    return error


async def _tokenizer_worker(state: GatewayState, model: str | None) -> AsyncWorkerClient:
    """The least busy healthy worker, once ``model`` (if given) is known: 404 otherwise."""
    if model is not None and model != state.pool.base_model:
        try:
            await state.in_thread(state.store.describe, model)
        except AdapterNotFound as exc:
            raise ApiError(404, f"the model {model!r} does not exist: {exc}", param="model",
                           code="model_not_found") from exc
    healthy = [w for w in state.pool.workers.values() if w.healthy]
    if not healthy:
        raise NoHealthyWorker("no healthy worker has the tokenizer; retry shortly")
    return min(healthy, key=lambda w: w.load).client
