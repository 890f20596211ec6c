"""Domain exceptions <-> gRPC status codes, in one place.

Servers install :class:`ErrorMappingInterceptor`; clients call :func:`raise_from_rpc_error` so the
CLI and the worker see the same domain exceptions the server raised.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from lorastream.core import errors

log = logging.getLogger(__name__)

_CODES: dict[type[errors.LorastreamError], grpc.StatusCode] = {
    errors.AdapterNotFound: grpc.StatusCode.NOT_FOUND,
    errors.InvalidAdapter: grpc.StatusCode.INVALID_ARGUMENT,
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.SourceUnavailable: grpc.StatusCode.UNAVAILABLE,
    errors.CapacityExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.Conflict: grpc.StatusCode.FAILED_PRECONDITION,
    errors.Cancelled: grpc.StatusCode.CANCELLED,
}
_EXCEPTIONS: dict[grpc.StatusCode, type[errors.LorastreamError]] = {
    grpc.StatusCode.NOT_FOUND: errors.AdapterNotFound,
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.UNAVAILABLE: errors.SourceUnavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.CapacityExhausted,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
    grpc.StatusCode.ALREADY_EXISTS: errors.AlreadyExists,
    grpc.StatusCode.CANCELLED: errors.Cancelled,
    grpc.StatusCode.FAILED_PRECONDITION: errors.Conflict,
}


# Trailing metadata on every status a server's interceptor sends for a domain error: a client can
# then tell "the server said UNAVAILABLE" (a source behind it is down) from a transport failure
# (the server itself is unreachable or went away), which carries no such key.
DOMAIN_ERROR_KEY = "lorastream-error"


def status_code_for(exc: BaseException) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in _CODES:
            return _CODES[cls]  # type: ignore[index]
    return grpc.StatusCode.INTERNAL


def _abort(context: grpc.ServicerContext, exc: BaseException) -> None:
    code = status_code_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("internal error in RPC")
        context.abort(code, f"internal error: {type(exc).__name__}: {exc}")
    context.set_trailing_metadata(((DOMAIN_ERROR_KEY, type(exc).__name__),))
    context.abort(code, str(exc))


def reported_by_server(err: grpc.RpcError) -> bool:
    """True when ``err`` is a status a lorastream server sent for a domain error."""
    try:
        metadata = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    except Exception:  # noqa: BLE001 - a call that never reached a server has none
        return False
    return any(key == DOMAIN_ERROR_KEY for key, _ in (metadata or ()))


class ErrorMappingInterceptor(grpc.ServerInterceptor):
    """Turns domain exceptions raised by servicer methods into gRPC status codes.

    Servicers raise domain exceptions and never call ``context.abort`` themselves: abort raises a
    plain ``Exception`` that this interceptor could not tell from a bug.
    """

    def intercept_service(self, continuation: Callable[..., Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        if handler.unary_unary:
            inner_uu = handler.unary_unary

            def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
                try:
                    return inner_uu(request, context)
                except Exception as exc:  # noqa: BLE001 - unknown ones map to INTERNAL, logged
                    _abort(context, exc)

            return handler._replace(unary_unary=unary_unary)
        if handler.unary_stream:
            inner_us = handler.unary_stream

            def unary_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                try:
                    yield from inner_us(request, context)
                except Exception as exc:  # noqa: BLE001 - unknown ones map to INTERNAL, logged
                    _abort(context, exc)

            return handler._replace(unary_stream=unary_stream)
        return handler


def raise_from_rpc_error(err: grpc.RpcError) -> None:
    """Re-raise a client-side RpcError as the matching domain exception (or as is)."""
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    exc_type = _EXCEPTIONS.get(code) if code is not None else None
    if exc_type is None:
        raise err
    if code is grpc.StatusCode.UNAVAILABLE and not reported_by_server(err):
        raise errors.ServerUnreachable(
            f"cannot reach the server, or the connection to it broke: {details}"
        ) from err
    raise exc_type(details) from err


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Requires ``authorization: Bearer <token>`` metadata on the listed methods.

    ``protected`` holds full method names (``/lorastream.adapter_store.v1.AdapterStoreService/PinAdapter``).
    With ``token`` None or empty, every call passes.
    """

    def __init__(self, token: str | None, protected: set[str]) -> None:
        self._expected = f"Bearer {token}" if token else None
        self._protected = protected

    def intercept_service(self, continuation: Callable[..., Any], details: Any) -> Any:
        if self._expected is None or details.method not in self._protected:
            return continuation(details)
        metadata = dict(details.invocation_metadata or ())
        if metadata.get("authorization") == self._expected:
            return continuation(details)
        handler = continuation(details)
        message = (
            "this operator call needs a bearer token: pass --token (or set LORASTREAM_TOKEN) to "
            "the one the server was started with"
            if "authorization" not in metadata
            else "the bearer token is wrong: use the one the server was started with"
        )

        def deny_unary(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        def deny_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover - abort raises

        if handler.unary_stream:
            return handler._replace(unary_stream=deny_stream)
        return handler._replace(unary_unary=deny_unary)
