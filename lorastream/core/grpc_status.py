"""Domain exceptions <-> gRPC status codes, in one place.

Servers install :class:`ErrorMappingInterceptor`; clients call :func:`raise_from_rpc_error` so the
CLI and the worker see the same domain exceptions the server raised.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NoReturn, cast

import grpc

from lorastream.core import errors
from lorastream.core.auth import AccessTokens, Scope, bearer_of

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
            return _CODES[cls]
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
        # grpc's stubs name the entries _Metadatum (.key, .value); at run time they are (key, value)
        # namedtuples, and a grpc.aio error's metadata is (key, value) pairs too
        pairs = cast("Iterable[tuple[str, str | bytes]]", metadata or ())
    except Exception:
        return False
    return any(key == DOMAIN_ERROR_KEY for key, _ in pairs)


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
                except Exception as exc:
                    _abort(context, exc)

            return handler._replace(unary_unary=unary_unary)
        if handler.unary_stream:
            inner_us = handler.unary_stream

            def unary_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                try:
                    yield from inner_us(request, context)
                except Exception as exc:
                    _abort(context, exc)

            return handler._replace(unary_stream=unary_stream)
        if handler.stream_unary:
            inner_su = handler.stream_unary

            def stream_unary(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
                try:
                    return inner_su(requests, context)
                except Exception as exc:
                    _abort(context, exc)

            return handler._replace(stream_unary=stream_unary)
        return handler


def raise_from_rpc_error(err: grpc.RpcError) -> NoReturn:
    """Re-raise a client-side RpcError as the matching domain exception (or as is)."""
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    exc_type = _EXCEPTIONS.get(code) if code is not None else None
    if exc_type is None:
        raise err
    if code is grpc.StatusCode.UNAVAILABLE and not reported_by_server(err):
        raise errors.ServerUnreachable(
            f"cannot reach the server, or the connection to it broke: {details}"
            f"{_tls_hint(details or '')}"
        ) from err
    raise exc_type(details) from err


def _tls_hint(details: str) -> str:
    """What to check when a connection failure looks like TLS: a handshake that failed here
    (the server's certificate is not trusted) or a connection the server closed at once (a TLS
    server closes plaintext clients and, with mutual TLS, clients without a certificate it
    accepts)."""
    text = details.lower()
    if "handshake" in text or "ssl" in text or "certificate" in text:
        return (
            " (TLS handshake failed: does the client trust the CA that signed the server's "
            "certificate (--tls-ca), and is the certificate valid for the address dialled?)"
        )
    if "socket closed" in text:
        return (
            " (if the server uses TLS: connect with --tls-ca; with mutual TLS, present a "
            "certificate from its client CA with --tls-client-cert/--tls-client-key)"
        )
    return ""


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Requires ``authorization: Bearer <token>`` metadata of the right scope on listed methods.

    ``required`` maps full method names
    (``/lorastream.adapter_store.v1.AdapterStoreService/PinAdapter``) to the scope they need;
    other methods (health, reflection, generation) pass. With no token configured, every call
    passes, unless ``refuse_without_token`` is given: then every listed call is refused with that
    message (a server whose listed calls must never be open by accident). Tokens are compared in
    constant time and never logged.
    """

    def __init__(self, tokens: AccessTokens, required: Mapping[str, Scope],
                 refuse_without_token: str | None = None) -> None:
        self._tokens = tokens
        self._required = dict(required)
        self._refuse_without_token = refuse_without_token

    def intercept_service(self, continuation: Callable[..., Any], details: Any) -> Any:
        scope = self._required.get(details.method)
        if scope is None:
            return continuation(details)
        if not self._tokens.enabled:
            if self._refuse_without_token is None:
                return continuation(details)
            log.info("refused %s: %s", details.method, self._refuse_without_token)
            return _denied(continuation(details), self._refuse_without_token)
        metadata = dict(details.invocation_metadata or ())
        presented = bearer_of(metadata.get("authorization"))
        if self._tokens.allows(presented, scope):
            return continuation(details)
        handler = continuation(details)
        if presented is None:
            message = (
                f"this call needs a bearer token of scope {scope.value!r}: pass the server's "
                "token (LORASTREAM_TOKEN, or the client's token file)"
            )
        elif self._tokens.scopes_of(presented):
            message = (
                f"this call needs a token of scope {scope.value!r}; the one given is read-only"
            )
        else:
            message = "the bearer token is wrong: use the one the server was started with"
        log.info("refused %s: %s", details.method, message)
        return _denied(handler, message)


def _denied(handler: Any, message: str) -> Any:
    """``handler`` with its behaviour replaced by an UNAUTHENTICATED abort saying ``message``."""

    def deny_unary(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    def deny_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - abort raises

    def deny_upload(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.unary_stream:
        return handler._replace(unary_stream=deny_stream)
    if handler.stream_unary:
        return handler._replace(stream_unary=deny_upload)
    return handler._replace(unary_unary=deny_unary)
