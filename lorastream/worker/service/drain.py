"""The GPU worker's graceful stop: readiness off, no new generations, a deadline for the rest.

On the first SIGINT/SIGTERM (``lorastream.core.grpc_service.serve_until_signalled``),
:meth:`WorkerDrain.run`:

1. sets gRPC health NOT_SERVING: every gateway's health ``Watch`` stream hears it at once and
   routes around the worker (Kubernetes' gRPC readiness probe fails too);
2. refuses new generations (``Generate``) with UNAVAILABLE, "draining";
3. returns when no request is waiting or running, or after ``drain_seconds``.

The server then stops the engine, which ends what is left with UNAVAILABLE ("the worker is
shutting down; retry the request"), and the process exits with status 0.
"""

from __future__ import annotations

import logging
import threading
import time

from grpc_health.v1 import health

from lorastream.core.errors import SourceUnavailable
from lorastream.worker.engine.engine import Engine

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often the drain looks at the engine's queue


class WorkerDrain:
    def __init__(self, engine: Engine, health_servicer: health.HealthServicer,
                 seconds: float) -> None:
        self._engine = engine
        self._health = health_servicer
        self.seconds = seconds
        self._draining = threading.Event()
        self._hurry = threading.Event()

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    def refuse_if_draining(self) -> None:
        """Raise SourceUnavailable (UNAVAILABLE on the wire) while the worker drains."""
        if self._draining.is_set():
            raise SourceUnavailable(
                "the worker is draining before it stops and takes no new requests; retry on "
                "another worker"
            )

    def run(self) -> None:
        """Turn readiness off and refuse new generations; return when the engine has no
        request left, after ``seconds``, or at once after :meth:`hurry`."""
        self._draining.set()
        self._health.enter_graceful_shutdown()  # NOT_SERVING, pushed to every Watch stream
        started = time.monotonic()
        deadline = started + self.seconds
        log.info("gpu worker draining: health NOT_SERVING, new requests refused; waiting up "
                 "to %.0f s for %d running and %d waiting request(s)", self.seconds,
                 self._engine.running, self._engine.waiting)
        while self._engine.running + self._engine.waiting > 0:
            left = deadline - time.monotonic()
            if left <= 0 or self._hurry.wait(min(POLL_S, left)):
                log.warning("drain ended after %.1f s with %d running and %d waiting "
                            "request(s): they end with UNAVAILABLE",
                            time.monotonic() - started, self._engine.running,
                            self._engine.waiting)
                return
        log.info("drained in %.1f s", time.monotonic() - started)

    def hurry(self) -> None:
        """End :meth:`run` now (a second signal)."""
        self._hurry.set()
