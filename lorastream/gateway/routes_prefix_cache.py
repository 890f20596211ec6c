"""Operator endpoint: ``POST /v1/prefix-cache/reset`` forgets every worker's cached prompt
prefixes (docs/worker.md, "Prefix caching"): after a model or tokenizer change outside the
cache's key, or to measure cold prefills. Needs the operate token when the gateway has one."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, Depends, Request

from lorastream.core.errors import LorastreamError
from lorastream.gateway.auth import require_operator
from lorastream.gateway.state import gateway_state

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/prefix-cache", dependencies=[Depends(require_operator)])


@router.post("/reset")
async def reset(request: Request) -> dict[str, Any]:
    """Reset every healthy worker's prefix cache; per worker, done or its error."""
    state = gateway_state(request)
    healthy = [w.target for w in state.pool.workers.values() if w.healthy]

    async def one(target: str) -> str | None:
        try:
            await state.pool.get(target).client.reset_prefix_cache()
        except LorastreamError as exc:
            return str(exc)
        return None

    outcome = dict(zip(healthy, await asyncio.gather(*(one(t) for t in healthy)), strict=True))
    log.info("prefix cache reset on %d of %d workers", sum(e is None for e in outcome.values()),
             len(outcome))
    return {
        "reset": [target for target, error in outcome.items() if error is None],
        "errors": {target: error for target, error in outcome.items() if error is not None},
    }
