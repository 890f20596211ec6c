"""Layer-ordered admission, the adapter manager's side (docs/design.md, "Layer-ordered
admission"): a slot for an adapter still landing, filled layer by layer as the fetch reports.

The manager calls both functions with its lock held. The order of events for one adapter:

1. its fetch starts; the first layers land (``AdapterEntry.layers_landed``);
2. a request waits for it and ``--layered-admission`` is on: :func:`landing_weights` maps the
   adapter's reserved host range (the bytes of layers not landed yet are not read), the device
   tier claims a slot and submits the landed layers' copies (``DeviceTier.claim_layers``);
3. each later report submits the next layers' copies (:func:`follow_landing`), and the end of
   the fetch all of them (layers the adapter leaves alone still need zeroing);
4. a failed fetch takes the partly filled slot back: it holds no adapter.
"""

from __future__ import annotations

from lorastream.worker.device.device import Device
from lorastream.worker.loading.adapter_weights import AdapterWeights, adapter_weights
from lorastream.worker.loading.device_tier import DeviceTier
from lorastream.worker.loading.entry import AdapterEntry
from lorastream.worker.loading.host_buffer import HostAdapterBuffer
from lorastream.worker.loading.host_tier import HostTier
from lorastream.worker.loading.layered_copy import LayeredCopy
from lorastream.worker.model.config import ModelConfig


def landing_weights(entry: AdapterEntry, host: HostTier, device: Device, config: ModelConfig,
                    max_rank: int) -> AdapterWeights | None:
    """``entry``'s tensors as views of its reserved host range, while its fetch lands them;
    None when it has no range of the arena (nothing to map before the fetch ends). Raises
    InvalidAdapter when the manifest does not fit the base model (rule 6 needs only the
    manifest)."""
    storage = host.storage(entry)
    if storage is None:
        return None
    buffer = HostAdapterBuffer(device, storage)
    buffer.adopt(entry.manifest, 0.0)  # the layout only: the bytes are the fetch's to land
    return adapter_weights(buffer, config, max_rank)


def follow_landing(tier: DeviceTier, entry: AdapterEntry) -> None:
    """The fetch of ``entry`` reported progress, ended or failed: submit the copies of the
    layers that landed, or of all of them, or take the slot back."""
    copy = entry.slot_event
    if entry.slot is None or not isinstance(copy, LayeredCopy):
        return
    if entry.weights is not None:  # landed whole and checked
        copy.land(copy.num_layers)
    elif entry.fetching:
        copy.land(entry.layers_landed)
    else:  # the fetch failed: the slot holds part of an adapter that will not come
        tier.evict(entry)
