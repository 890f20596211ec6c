"""Refuse request bodies over a byte limit with a 413 in OpenAI's error format.

Checked on ``Content-Length`` before anything is read, and counted while a chunked body arrives.
(FastAPI's own ``max_body_size`` answers with its default body, not OpenAI's.)
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lorastream.gateway.http_errors import ApiError


def _message(limit: int) -> str:
    return f"the request body is larger than the gateway's limit of {limit} bytes"


class BodyTooLarge(HTTPException):
    """Raised while reading: an HTTPException, so FastAPI passes it on to the error handlers."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, _message(limit))


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            error = ApiError(413, _message(self.max_bytes), code="request_too_large")
            await error.response()(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, counted, send)
