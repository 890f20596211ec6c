"""Every error as OpenAI's body ``{"error": {"message", "type", "param", "code"}}`` and a status.

| error | status | type / code |
| --- | --- | --- |
| malformed JSON, invalid or unsupported parameter, prompt too long | 400 | invalid_request_error |
| missing or wrong operator token | 401 | authentication_error |
| unknown model or adapter | 404 | invalid_request_error / model_not_found |
| name already staged from another source, conflict | 409 | invalid_request_error / conflict |
| body larger than ``max_body_bytes`` | 413 | invalid_request_error / request_too_large |
| every healthy worker full, budget exhausted | 429 | rate_limit_error / capacity_exhausted |
| no healthy worker; the store or a source unreachable | 503 | service_unavailable |
| a worker did not answer within the deadline | 504 | timeout |
| a worker failed unexpectedly | 502 | worker_error |
| a worker went away mid-request (killed, restarting) | 502 | worker_error / worker_unavailable |
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from lorastream.core import errors
from lorastream.gateway.errors import (
    ClientGone,
    NoHealthyWorker,
    UpstreamTimeout,
    WorkerFailed,
    WorkerUnavailable,
)

log = logging.getLogger(__name__)

_NOT_AN_OBJECT = ("model_attributes_type", "dict_type", "model_type")
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "max_tokens", "seed", "stop_token_ids",
                    "stop", "ignore_eos", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "logit_bias", "min_tokens", "logprobs",
                    "response_format", "structured_outputs", "tools", "tool_choice")


@dataclass
class ApiError(Exception):
    """An error response: HTTP status and OpenAI's error fields."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


# (status, type, code) per domain error; the first matching class in the MRO wins.
_TABLE: dict[type[BaseException], tuple[int, str, str | None]] = {
    errors.AdapterNotFound: (404, "invalid_request_error", "model_not_found"),
    errors.InvalidArgument: (400, "invalid_request_error", "invalid_value"),
    errors.InvalidAdapter: (400, "invalid_request_error", "invalid_adapter"),
    errors.Unauthenticated: (401, "authentication_error", "invalid_api_key"),
    errors.AlreadyExists: (409, "invalid_request_error", "conflict"),
    errors.Conflict: (409, "invalid_request_error", "conflict"),
    errors.CapacityExhausted: (429, "rate_limit_error", "capacity_exhausted"),
    NoHealthyWorker: (503, "service_unavailable", "no_healthy_worker"),
    errors.SourceUnavailable: (503, "service_unavailable", "source_unavailable"),
    errors.Cancelled: (503, "service_unavailable", "cancelled"),
    ClientGone: (499, "invalid_request_error", "client_closed_request"),
    UpstreamTimeout: (504, "timeout", "timeout"),
    WorkerUnavailable: (502, "worker_error", "worker_unavailable"),
    WorkerFailed: (502, "worker_error", None),
}


def api_error(exc: BaseException, prompt_param: str = "prompt") -> ApiError:
    """The response for a domain error; ``prompt_param`` names the prompt field of the endpoint."""
    if isinstance(exc, ApiError):
        return exc
    for cls in type(exc).__mro__:
        if cls in _TABLE:
            status, kind, code = _TABLE[cls]
            message = str(exc)
            return ApiError(status, message, kind, _guess_param(message, prompt_param), code)
    log.exception("unexpected error", exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")


def _guess_param(message: str, prompt_param: str) -> str | None:
    """The request field a worker's InvalidArgument message is about (its first word)."""
    first = message.split(" ", 1)[0].removesuffix(":")
    if first in _SAMPLING_FIELDS:
        return first
    if "prompt" in message:
        return prompt_param
    return None


def _validation_error(exc: RequestValidationError) -> ApiError:
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error") or first.get("msg", "")
        return ApiError(400, f"the request body is not valid JSON: {detail}", code="invalid_json")
    if tuple(first.get("loc", ())) == ("body",) and first.get("type") in _NOT_AN_OBJECT:
        return ApiError(400, "the request body must be a JSON object, sent with "
                        "'Content-Type: application/json'", code="invalid_json")
    # a body field or a query parameter: the location starts with where it was read from
    loc = [str(p) for p in first.get("loc", ())
           if p not in ("body", "query") and not isinstance(p, int)]
    # Union members add their type to the location (prompt.str, prompt.list[int]): keep the field.
    param = loc[0] if loc else None
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if first.get("type") == "missing":
        message = "this field is required"
    return ApiError(400, f"{param}: {message}" if param else message, param=param,
                    code="invalid_value")


def install_handlers(app: FastAPI) -> None:
    """Make every error leave as OpenAI's error body."""

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        return api_error(exc).response()

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return _validation_error(exc).response()

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        codes = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
                 413: "request_too_large"}
        kind = "authentication_error" if exc.status_code == 401 else "invalid_request_error"
        return ApiError(exc.status_code, str(exc.detail), kind,
                        code=codes.get(exc.status_code)).response()

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(errors.LorastreamError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(HTTPException, on_http)
    app.add_exception_handler(Exception, on_api_error)
