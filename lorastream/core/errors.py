"""Domain exceptions shared by every service.

Core logic raises these; one gRPC interceptor (``lorastream.core.grpc_status``) maps them to status
codes, and the client side maps status codes back. Messages tell the user what to fix.
"""

from __future__ import annotations


class LorastreamError(Exception):
    """Base class of every domain error."""


class AdapterNotFound(LorastreamError):
    """The named adapter (or the object a source points at) does not exist."""


class InvalidAdapter(LorastreamError):
    """The adapter's files are malformed, inconsistent, unsafe or do not fit the base model."""


class InvalidArgument(LorastreamError):
    """A request parameter is out of range or malformed (bad URI, bad sampling parameter, ...)."""


class SourceUnavailable(LorastreamError):
    """A remote source (S3, the Hub, the store) cannot be reached or keeps failing after retries."""


class ServerUnreachable(SourceUnavailable):
    """The server itself could not be reached, or the connection to it broke mid-call.

    Unlike its parent, which a server reports about a source behind it, this one comes from the
    transport: nothing answered. For a worker, the store is its adapter source, hence the parent.
    """


class CapacityExhausted(LorastreamError):
    """A budget is full: disk cache, host memory, device slots, KV cache or the waiting queue."""


class Unauthenticated(LorastreamError):
    """A bearer token is missing or wrong."""


class AlreadyExists(LorastreamError):
    """A name is already registered with different content, and the request did not ask to
    replace it."""


class Conflict(LorastreamError):
    """What the request assumed changed meanwhile (e.g. a name was replaced mid-stream)."""


class Cancelled(LorastreamError):
    """The operation was cancelled by its caller."""
