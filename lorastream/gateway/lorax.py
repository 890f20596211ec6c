"""LoRAX's ``adapter_source`` in a generation request, checked against the staged adapter.

LoRAX names an adapter by ``adapter_id`` and says where it comes from with ``adapter_source``
(``hub``, ``s3``, ``local``, ``pbase``). Here adapters come only from the store, so the pair is
honoured when the adapter the request names is staged from a source of that kind (an operator
preloads ``org/repo`` from ``hf://org/repo`` under the name ``org/repo``); anything else is a
400 naming ``adapter_source`` (never ignored: a request must not be answered by other weights
than the ones it asked for). The message names the kind, never the source itself (paths and
buckets are for operators).
"""

from __future__ import annotations

from lorastream.core.errors import AdapterNotFound
from lorastream.gateway.http_errors import ApiError
from lorastream.gateway.state import GatewayState

# LoRAX's source -> the URI scheme the store stages it from ("" : a local path)
_SCHEMES = {"hub": "hf://", "s3": "s3://", "local": ""}


def source_kind(source_uri: str) -> str:
    """LoRAX's name for where a staged adapter came from (``push`` for an upload)."""
    lowered = source_uri.lower()
    for kind, scheme in _SCHEMES.items():
        if scheme and lowered.startswith(scheme):
            return kind
    return "push" if lowered.startswith("push://") else "local"


async def check_adapter_source(
    state: GatewayState, model: str, adapter_id: str | None, adapter_source: str
) -> None:
    """ApiError 400 (param ``adapter_source``) unless ``model`` is staged from a source of
    ``adapter_source``'s kind; an unknown model is left to the generation's own 404."""
    if adapter_source == "pbase":
        raise _refuse("adapter_source 'pbase' (Predibase) is not served here: preload the adapter "
                      "into the store and send adapter_source 'hub', 's3' or 'local'")
    if adapter_id is None:
        raise _refuse("adapter_source needs adapter_id: name the adapter it applies to")
    if model == state.pool.base_model:
        raise _refuse(f"{model!r} is the base model, which has no adapter_source; leave it unset")
    try:
        manifest = await state.in_thread(state.store.describe, model)
    except AdapterNotFound:
        return
    kind = source_kind(manifest.source_uri)
    if kind != adapter_source:
        hint = f"send adapter_source {kind!r}, or leave it unset" if kind in _SCHEMES \
            else "leave adapter_source unset"
        raise _refuse(f"adapter {model!r} is staged from a {kind} source, not {adapter_source}; "
                      f"{hint}")


def _refuse(message: str) -> ApiError:
    return ApiError(400, message, param="adapter_source", code="invalid_value")
