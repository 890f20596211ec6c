"""What the request handlers share: settings, metrics, the worker pool, the router, the store."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ParamSpec, TypeVar

from starlette.requests import Request

from lorastream.core.store_client import StoreClient
from lorastream.gateway.config import GatewaySettings
from lorastream.gateway.dispatch import Dispatcher
from lorastream.gateway.drain import Drain
from lorastream.gateway.metrics import GatewayMetrics
from lorastream.gateway.routing import Router
from lorastream.gateway.worker_pool import WorkerPool

P = ParamSpec("P")
T = TypeVar("T")


@dataclass
class GatewayState:
    settings: GatewaySettings
    metrics: GatewayMetrics
    pool: WorkerPool
    router: Router
    dispatcher: Dispatcher
    store: StoreClient  # blocking: call through :meth:`in_thread`
    started_at: int  # unix seconds
    drain: Drain = field(default_factory=Drain)  # the graceful stop (lorastream.gateway.drain)

    async def in_thread(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run a blocking call (the store client) off the event loop."""
        return await asyncio.to_thread(fn, *args, **kwargs)


def gateway_state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state
