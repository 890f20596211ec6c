"""The soak benchmark's client side: one streamed chat completion through the gateway, and how
its outcome is counted.

A request ends in exactly one outcome (:func:`outcome`): ``ok`` (200, ``[DONE]``),
``cancelled`` (200, closed by the client mid-stream on purpose), ``rejected_429``,
``unavailable_503_worker_alive`` / ``unavailable_503_no_worker`` (503 while at least one worker
process was serving, or none; from the worker lifetimes the benchmark recorded),
``error_midstream`` (200, then an error event: a worker killed under a started stream) and
``error`` (anything else: another status, a transport failure, a stream cut without
``[DONE]``).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import httpx

OUTCOMES = ("ok", "cancelled", "rejected_429", "unavailable_503_worker_alive",
            "unavailable_503_no_worker", "error_midstream", "error")

Interval = tuple[float, float]  # (serving since, gone at) in perf_counter seconds


@dataclass
class SoakRequest:
    """One request of the soak and what came back; times are ``time.perf_counter()`` values."""

    adapter: str
    question: str
    cancel_after: int | None  # close the stream after this many content chunks; None: read all
    arrival: float = 0.0
    status: int | None = None
    first_token: float | None = None
    end: float | None = None
    chunks: int = 0
    text: str = ""
    done: bool = False  # [DONE] seen
    cancelled: bool = False  # closed by the client as planned
    error: str | None = None  # an error event's code, a transport error, or a body's message
    retry_after: str | None = None
    failed_at: float | None = None  # when a 503 came back


def chat_body(model: str, question: str, max_tokens: int) -> dict[str, object]:
    """A greedy streamed chat completion: the same request gives the same text."""
    return {"model": model, "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0.0, "stream": True}


def send(client: httpx.Client, url: str, request: SoakRequest, max_tokens: int) -> None:
    """Stream ``request`` to ``url`` (``/v1/chat/completions``); every outcome is recorded in
    ``request``, nothing is raised."""
    request.arrival = time.perf_counter()
    try:
        with client.stream("POST", url, json=chat_body(request.adapter, request.question,
                                                       max_tokens)) as response:
            request.status = response.status_code
            if response.status_code != 200:
                request.failed_at = time.perf_counter()
                request.retry_after = response.headers.get("retry-after")
                request.error = _error_code(response.read())
                return
            _read_events(response.iter_lines(), request)
    except httpx.HTTPError as err:
        request.error = f"{type(err).__name__}: {err}"
    finally:
        request.end = time.perf_counter()


def _read_events(lines: Iterable[str], request: SoakRequest) -> None:
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            request.done = True
            return
        event = json.loads(data)
        if "error" in event:
            request.error = str(event["error"].get("code") or event["error"].get("message"))
            continue
        content = (event.get("choices") or [{}])[0].get("delta", {}).get("content")
        if not content:
            continue
        if request.first_token is None:
            request.first_token = time.perf_counter()
        request.text += content
        request.chunks += 1
        if request.cancel_after is not None and request.chunks >= request.cancel_after:
            request.cancelled = True
            return  # leaving the `with` closes the connection: the gateway cancels it


def _error_code(body: bytes) -> str:
    try:
        error = json.loads(body).get("error") or {}
    except (ValueError, AttributeError):
        return body[:200].decode(errors="replace")
    return str(error.get("code") or error.get("message") or error)


def alive_at(t: float, lifetimes: Sequence[Sequence[Interval]]) -> bool:
    """Whether any worker process was serving at ``t`` (``lifetimes``: per worker, its
    processes' serving intervals; an open end is ``inf``)."""
    return any(begin <= t <= end for worker in lifetimes for begin, end in worker)


def outcome(request: SoakRequest, lifetimes: Sequence[Sequence[Interval]]) -> str:
    """The one outcome of ``request`` (see the module docstring)."""
    if request.status == 200:
        if request.cancelled:
            return "cancelled"
        if request.done and request.error is None:
            return "ok"
        return "error_midstream" if request.error is not None else "error"
    if request.status == 429:
        return "rejected_429"
    if request.status == 503:
        at = request.failed_at if request.failed_at is not None else request.arrival
        alive = alive_at(at, lifetimes)
        return "unavailable_503_worker_alive" if alive else "unavailable_503_no_worker"
    return "error"


def count_outcomes(requests: Iterable[SoakRequest],
                   lifetimes: Sequence[Sequence[Interval]]) -> dict[str, int]:
    """Requests per outcome, every outcome present (0 when none)."""
    counts = Counter(outcome(r, lifetimes) for r in requests)
    return {name: counts.get(name, 0) for name in OUTCOMES}


def error_kinds(requests: Iterable[SoakRequest], lifetimes: Sequence[Sequence[Interval]],
                top: int = 8) -> dict[str, int]:
    """The most frequent error texts among requests counted as errors or 503s."""
    counted = Counter(
        f"{outcome(r, lifetimes)}: {r.status}: {r.error}" for r in requests
        if outcome(r, lifetimes) not in ("ok", "cancelled", "rejected_429")
    )
    return dict(counts for counts in counted.most_common(top))
