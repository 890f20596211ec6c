"""Errors the gateway itself raises, beside the shared domain errors of ``lorastream.core.errors``.

Plain exceptions (no HTTP here): ``lorastream.gateway.http_errors`` maps every one to a status
code and OpenAI's error body.
"""

from __future__ import annotations

from lorastream.core.errors import LorastreamError


class NoHealthyWorker(LorastreamError):
    """No worker is healthy (or every healthy one was tried)."""


class UpstreamTimeout(LorastreamError):
    """A worker or the store did not answer within the gateway's deadline."""


class WorkerFailed(LorastreamError):
    """A worker answered with an error the gateway cannot attribute to the request."""


class WorkerUnavailable(WorkerFailed):
    """A worker could not be reached, or its connection broke mid-request (killed, restarting):
    the worker itself, not an adapter source behind it."""


class ClientGone(LorastreamError):
    """The HTTP client disconnected; its worker request was cancelled."""
