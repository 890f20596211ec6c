"""Route a generation to a worker, start it, and move it elsewhere if that worker is dead.

A request is "started" when the worker sent its first event: errors the worker raises before that
(unknown adapter, bad parameters, prompt too long, capacity) reach the HTTP client as proper
status codes, and a worker that turns out to be unreachable is marked down and the request is
sent to the next choice. After the first event a request is tied to its worker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from lorastream.core.errors import Cancelled, SourceUnavailable
from lorastream.core.generation import FinishReason, GenerationEvent, PromptInput, SamplingParams
from lorastream.gateway.async_worker_client import GenerationCall
from lorastream.gateway.errors import ClientGone, WorkerFailed, WorkerUnavailable
from lorastream.gateway.metrics import GatewayMetrics
from lorastream.gateway.prefix_affinity import prefix_keys
from lorastream.gateway.routing import RouteDecision, Router
from lorastream.gateway.worker_pool import WorkerPool

log = logging.getLogger(__name__)

ROUTED = "request %s for %s -> %s (%s)"
"""The debug line of each routed generation: its request id (the OpenAI response's ``id``), model,
worker and reason (``lorastream bench prefix`` reads it to see where each turn went)."""


class Generation:
    """One routed generation; its first event has arrived once :meth:`Dispatcher.start` returns.

    Records TTFT, inter-token latency, end-to-end latency and tokens of its model, and releases
    its worker's in-flight count on :meth:`close` (idempotent; also when iteration ends).
    """

    def __init__(
        self,
        pool: WorkerPool,
        metrics: GatewayMetrics,
        decision: RouteDecision,
        call: GenerationCall,
        model: str,
        arrived_at: float,
        choices: int = 1,
    ) -> None:
        self.decision = decision
        self.model = model
        self._pool = pool
        self._metrics = metrics
        self._call = call
        self._stream = call.events()
        self._arrived_at = arrived_at
        self._last_token_at: float | None = None
        self._first: GenerationEvent | None = None
        self._closed = False
        self._open_choices = choices  # each of the n choices ends with its own finish reason
        self._choice_tokens = 0

    @property
    def target(self) -> str:
        return self.decision.target

    async def first(self) -> GenerationEvent:
        """Wait for the worker's first event (raises the worker's error, if any)."""
        try:
            self._first = await anext(self._stream)
        except StopAsyncIteration:
            if self._call.cancelled_locally:
                raise ClientGone("the client went away; the request was cancelled") from None
            raise WorkerFailed(f"worker {self.target} ended the stream without a result") from None
        self._observe(self._first)
        return self._first

    async def events(self) -> AsyncIterator[GenerationEvent]:
        """Every event, the first included, until every choice's finish reason."""
        try:
            first = self._first or await self.first()
            yield first
            if self._open_choices == 0:
                return
            async for event in self._stream:
                self._observe(event)
                yield event
                if self._open_choices == 0:
                    return
            if self._call.cancelled_locally:
                raise ClientGone("the client went away; the request was cancelled")
            raise WorkerFailed(f"worker {self.target} ended the stream without a finish reason")
        finally:
            await self.aclose()

    def cancel(self) -> None:
        """Cancel the request on its worker (the client went away)."""
        self._call.cancel()

    async def aclose(self) -> None:
        """Cancel the RPC if still running and release the worker; safe while being cancelled."""
        if self._closed:
            return
        self._closed = True
        self._call.cancel()
        self._pool.release(self.target)
        await self._stream.aclose()

    def _observe(self, event: GenerationEvent) -> None:
        now = time.perf_counter()
        tokens = len(event.token_ids)
        if tokens and self._last_token_at is None:
            self._metrics.first_token(self.model, now - self._arrived_at)
            if tokens > 1:
                self._metrics.observe_tokens(self.model, 0.0, tokens - 1)
        elif tokens and self._last_token_at is not None:
            self._metrics.observe_tokens(self.model, now - self._last_token_at, tokens)
        if tokens:
            self._last_token_at = now
        if event.finish_reason is None:
            return
        self._open_choices -= 1
        self._choice_tokens += event.completion_tokens
        if self._open_choices == 0 and event.finish_reason is not FinishReason.CANCELLED:
            self._metrics.finished(self.model, now - self._arrived_at, self._choice_tokens)


class Dispatcher:
    def __init__(
        self,
        pool: WorkerPool,
        router: Router,
        metrics: GatewayMetrics,
        request_timeout_s: float,
    ) -> None:
        self._pool = pool
        self._router = router
        self._metrics = metrics
        self._timeout = request_timeout_s

    async def start(
        self,
        model: str,
        prompt: PromptInput,
        params: SamplingParams,
        request_id: str,
        arrived_at: float,
    ) -> Generation:
        """Route and start one generation; its first event is in hand when this returns.

        Raises the worker's domain errors, NoHealthyWorker (503) when no healthy worker is left,
        CapacityExhausted (429) when every healthy worker's queue is full.
        """
        failed: set[str] = set()
        is_base = model == self._pool.base_model
        prefixes = prefix_keys(prompt)  # the worker that served one last likely has it cached
        while True:
            views = self._pool.views()
            decision = self._router.choose(model, views, base_model=is_base, exclude=failed,
                                           prefixes=prefixes)
            self._metrics.routed(model, decision, views, base_model=is_base)
            self._pool.acquire(decision.target, None if is_base else model)
            worker = self._pool.get(decision.target)
            call = worker.client.generate(model, prompt, params, request_id, self._timeout)
            generation = Generation(self._pool, self._metrics, decision, call, model, arrived_at,
                                    choices=params.n)
            try:
                await generation.first()
            except (SourceUnavailable, Cancelled, WorkerUnavailable) as exc:
                await generation.aclose()
                if not await self._pool.confirm_down(decision.target):
                    raise
                log.warning("request %s: worker %s is down (%s); trying another",
                            request_id, decision.target, exc)
                self._metrics.retries.labels(decision.target).inc()
                failed.add(decision.target)
                continue
            except BaseException:
                await generation.aclose()
                raise
            log.debug(ROUTED, request_id, model, decision.target, decision.reason.value)
            return generation
