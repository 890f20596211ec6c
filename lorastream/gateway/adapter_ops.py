"""What the gateway's adapter endpoints do, shared by the operator API
(:mod:`~lorastream.gateway.routes_adapters`) and vLLM's load/unload endpoints
(:mod:`~lorastream.gateway.routes_vllm`): stage through the store, push into workers, forget."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from lorastream.core.errors import AdapterNotFound, LorastreamError
from lorastream.core.generation import AdapterStatus
from lorastream.core.manifest import AdapterManifest, PreloadProgress
from lorastream.gateway.state import GatewayState

log = logging.getLogger(__name__)


def run_preload(
    state: GatewayState,
    source: str,
    name: str,
    *,
    pin: bool = False,
    force: bool = False,
    on_event: Callable[[PreloadProgress], None] | None = None,
) -> AdapterManifest:
    """Blocking: drive the store's preload stream; return the manifest of the staged adapter."""
    manifest: AdapterManifest | None = None
    for event in state.store.preload(source, name, pin=pin, force=force):
        if on_event is not None:
            on_event(event)
        manifest = event.manifest or manifest
    if manifest is None:
        raise LorastreamError(f"the store ended the preload of {name} without a manifest")
    log.info("preloaded %s from %s (%d bytes)", name, source, manifest.total_bytes)
    return manifest


async def load_into(
    state: GatewayState, name: str, targets: list[str], pin: bool
) -> list[AdapterStatus | LorastreamError]:
    """Load ``name`` into each of ``targets`` at once; per target its status or its error."""

    async def one(target: str) -> AdapterStatus | LorastreamError:
        client = state.pool.get(target).client
        try:
            return await client.load_adapter(name, pin, state.settings.load_timeout_s)
        except LorastreamError as exc:
            return exc

    return list(await asyncio.gather(*(one(t) for t in targets)))


@dataclass
class Forgotten:
    """What :func:`forget` did: the workers it unloaded from, and the ones that failed."""

    unloaded: list[str] = field(default_factory=list)
    unload_errors: dict[str, str] = field(default_factory=dict)


async def forget(state: GatewayState, name: str) -> Forgotten:
    """Delete ``name`` in the store (AdapterNotFound when it is not staged), then unload it from
    every healthy worker that holds it."""
    await state.in_thread(state.store.delete, name)
    healthy = [w.target for w in state.pool.workers.values() if w.healthy]

    async def unload(target: str) -> str | None:
        """None when unloaded; "" when the worker did not hold it; else the error."""
        try:
            await state.pool.get(target).client.unload_adapter(name)
        except AdapterNotFound:
            return ""
        except LorastreamError as exc:
            return str(exc)
        return None

    outcome = dict(zip(healthy, await asyncio.gather(*(unload(t) for t in healthy)), strict=True))
    return Forgotten(
        unloaded=[target for target, error in outcome.items() if error is None],
        unload_errors={target: error for target, error in outcome.items() if error},
    )
