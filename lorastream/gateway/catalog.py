"""JSON views of the adapter catalogue: OpenAI model objects, worker residency.

A store manifest's own JSON is ``lorastream.core.manifest.manifest_json`` (shared with the CLI).
"""

from __future__ import annotations

from typing import Any

from lorastream.core.adapter_fit import BaseShape, misfit
from lorastream.core.generation import AdapterStatus
from lorastream.core.manifest import AdapterManifest
from lorastream.gateway.worker_pool import WorkerState

OWNER = "lorastream"


def base_of(
    m: AdapterManifest, bases: dict[str, BaseShape], fallback: str | None
) -> tuple[str | None, str | None]:
    """(the served base ``m`` fits, None) or (None, why it fits none of ``bases``).

    ``bases`` (served name -> shape, :meth:`WorkerPool.bases`) are what the workers serve; the
    store, and its cache shared by every stack on a machine, may hold adapters of other bases,
    which a worker would refuse at request time. With no base known (no worker polled yet, or
    workers that do not say) every adapter is taken as ``fallback``'s."""
    if not bases:
        return fallback, None
    reasons = []
    for name, shape in bases.items():
        reason = misfit(m, shape)
        if reason is None:
            return name, None
        reasons.append(f"not {name}: {reason}" if len(bases) > 1 else reason)
    return None, "; ".join(reasons)


def served_adapters(
    manifests: list[AdapterManifest], bases: dict[str, BaseShape], fallback: str | None
) -> list[tuple[AdapterManifest, str | None]]:
    """The adapters ``/v1/models`` lists, sorted by name, each with the base it fits (its
    ``parent``): only those some worker can serve, as vLLM lists only what it can serve."""
    listed: list[tuple[AdapterManifest, str | None]] = []
    for m in sorted(manifests, key=lambda m: m.name):
        base, why_not = base_of(m, bases, fallback)
        if why_not is None:
            listed.append((m, base))
    return listed


def base_model_object(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": OWNER,
            "root": name, "parent": None}


def adapter_model_object(
    m: AdapterManifest, base_model: str | None, show_source: bool = False
) -> dict[str, Any]:
    """An adapter as an OpenAI model object; its metadata under ``metadata``, with its source
    URI only when ``show_source`` (an operator asks: a path or bucket is not for every client)."""
    model: dict[str, Any] = {
        "id": m.name,
        "object": "model",
        "created": int(m.created_at),
        "owned_by": OWNER,
        "root": m.name,
        "parent": base_model,
        "metadata": {
            "rank": m.rank,
            "alpha": m.alpha,
            "use_rslora": m.use_rslora,
            "target_modules": list(m.target_modules),
            "source": m.source_uri,
            "revision": m.revision,
            "pinned": m.pinned,
            "adapter_id": m.adapter_id,
            "bytes": m.total_bytes,
        },
    }
    if not show_source:
        del model["metadata"]["source"]
    return model


def status_json(status: AdapterStatus) -> dict[str, Any]:
    """One adapter's state on one worker."""
    return {
        "residency": status.residency,
        "slot": status.slot if status.slot >= 0 else None,
        "references": status.references,
        "pinned": status.pinned,
        "bytes": status.nbytes,
    }


def residency_row(worker: WorkerState, name: str, adapters: list[AdapterStatus]) -> dict[str, Any]:
    """Where ``name`` is on ``worker`` ("absent" when the worker does not hold it)."""
    status = next((a for a in adapters if a.name == name), None)
    row: dict[str, Any] = {"worker": worker.target, "healthy": worker.healthy}
    if status is None:
        return {**row, "residency": "absent", "slot": None, "references": 0, "pinned": False,
                "bytes": 0}
    return {**row, **status_json(status)}


def residency_summary(workers: list[WorkerState]) -> dict[str, dict[str, str]]:
    """adapter name -> {worker: residency}, from the last poll of each worker."""
    summary: dict[str, dict[str, str]] = {}
    for worker in workers:
        for status in worker.adapters:
            summary.setdefault(status.name, {})[worker.target] = status.residency
    return summary
