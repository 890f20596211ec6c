"""SGMV LoRA kernels, tokens grouped by slot, cost following each adapter's real rank.

Shrink computes `x @ Aᵀ` into an fp32 rank-wide buffer; expand adds `scale * h @ Bᵀ` into the
layer output.

    meta = SgmvMetadata.from_slots(slots_cpu, ranks_cpu, device)        # once per step
    h = sgmv_shrink(x, lora_a, token_slots, ranks, meta=meta)           # per layer
    sgmv_expand(h, lora_b, token_slots, ranks, scalings, out, meta=meta)

Importing this package never imports Triton: the Triton kernels are defined on the first launch.
The torch reference (`sgmv_shrink_ref`, `sgmv_expand_ref`) needs only torch.
"""

from lorastream.kernels.metadata import SgmvMetadata
from lorastream.kernels.reference import sgmv_expand_ref, sgmv_expand_slices_ref, sgmv_shrink_ref
from lorastream.kernels.sgmv import SUPPORTED_DTYPES, sgmv_expand, sgmv_expand_slices, sgmv_shrink

__all__ = [
    "SUPPORTED_DTYPES",
    "SgmvMetadata",
    "sgmv_expand",
    "sgmv_expand_ref",
    "sgmv_expand_slices",
    "sgmv_expand_slices_ref",
    "sgmv_shrink",
    "sgmv_shrink_ref",
]
