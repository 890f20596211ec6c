"""How many of an adapter's leading layers have landed, verified, as its tensors arrive.

The store streams a manifest's tensors in layer order (``adapter_validation.layer_order``), so a
receiver holds layer 0 whole first, then layer 1, and so on; a cold request's prefill may run the
layers that have landed while the later ones still arrive. The receiver tells a
:class:`LayerProgress` each tensor whose digest it verified; it answers with the count of
*leading* layers all of whose tensors are verified, each time that count grows.

No torch here: the fetch process (``fetch_child``) imports it and must start fast.

The layers are the manifest's own: ``n = 1 + the highest layer any tensor names`` (the base
model's depth is not known in the fetch process). A layer no tensor names (an adapter of layers
0 and 2 only) counts as complete. Tensors of no layer complete only with the whole adapter: the
count stops at ``n - 1`` until they are verified too. Empty tensors take no bytes, land nothing
and are never verified by the stream, so they count as verified from the start.
"""

from __future__ import annotations

from collections.abc import Callable

from lorastream.core.adapter_format import parse_lora_key
from lorastream.core.manifest import AdapterManifest

LayersCallback = Callable[[int], None]  # called with the count of leading layers now landed


def manifest_layers(manifest: AdapterManifest) -> int:
    """Layers of ``manifest``: 1 + the highest layer a tensor names, 0 if none names one."""
    layers = [key.layer for t in manifest.tensors if (key := parse_lora_key(t.name)) is not None]
    return 1 + max(layers) if layers else 0


class LayerProgress:
    """The leading layers of one manifest whose tensors are all verified.

    Example: 3 layers, streamed in an old file-ordered manifest (layer 2 before layer 1)::

        tensors: 0: L0.A  1: L0.B  2: L2.A  3: L2.B  4: L1.A  5: L1.B
        verified(0) -> None   verified(1) -> 1     (layer 0 whole)
        verified(2) -> None   verified(3) -> None  (layer 2 whole, but layer 1 is not)
        verified(4) -> None   verified(5) -> 3     (layers 1 and 2: 3 leading layers)
        verified(5) -> None                        (again: nothing changes)
    """

    def __init__(self, manifest: AdapterManifest) -> None:
        self.layers = manifest_layers(manifest)
        self.landed = 0  # leading layers complete
        self._layer_of: list[int] = []  # tensor index -> layer, self.layers: of no layer
        self._pending = [0] * (self.layers + 1)  # per layer (then: of no layer), unverified
        self._verified = [t.nbytes == 0 for t in manifest.tensors]
        for info, done in zip(manifest.tensors, self._verified, strict=True):
            key = parse_lora_key(info.name)
            layer = self.layers if key is None else key.layer
            self._layer_of.append(layer)
            self._pending[layer] += not done
        self._advance()

    def verified(self, tensor_index: int) -> int | None:
        """Mark tensor ``tensor_index`` verified; the new count of leading complete layers when
        it grew, else None (also for a tensor marked before)."""
        if self._verified[tensor_index]:
            return None
        self._verified[tensor_index] = True
        self._pending[self._layer_of[tensor_index]] -= 1
        before = self.landed
        self._advance()
        return self.landed if self.landed > before else None

    def _advance(self) -> None:
        while self.landed < self.layers and not self._pending[self.landed]:
            if self.landed == self.layers - 1 and self._pending[self.layers]:
                return  # the last layer waits for the tensors of no layer
            self.landed += 1
