"""``--cpu-kernels``: whether this worker computes with the C++ CPU ops
(``lorastream/kernels/cpu/ops.py``: decode attention over the paged cache, the LoRA delta of
slot-major steps, RMSNorm and the rotary embedding, int8-dynamic's input rotation, int8's
weight-only product) or torch's paths.

``torch`` never; ``native`` always, or an error saying why it cannot; ``auto`` where the ops
apply (fp32 on the CPU) and build, else torch's paths with a warning giving the reason.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch

from lorastream.kernels.cpu import ops as cpu_ops

log = logging.getLogger(__name__)

CpuKernels = Literal["auto", "native", "torch"]


def use_cpu_kernels(choice: CpuKernels, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether to run the native ops (module docstring); builds them on first use."""
    if choice == "torch":
        return False
    if device.type != "cpu" or dtype != torch.float32:
        if choice == "native":
            raise ValueError(
                f"--cpu-kernels native: the C++ kernels run fp32 on the CPU; this model is "
                f"{str(dtype).removeprefix('torch.')} on {device}"
            )
        return False
    error = cpu_ops.load()
    if error is None:
        return True
    if choice == "native":
        raise RuntimeError(f"--cpu-kernels native: the C++ CPU kernels did not build: {error}")
    log.warning("the C++ CPU kernels did not build, so decode attention, the LoRA delta, "
                "RMSNorm, the rotary embedding, int8-dynamic's rotation and int8's product "
                "take torch's slower paths "
                "(--cpu-kernels torch silences this): %s", error)
    return False
