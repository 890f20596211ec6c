"""How the device layer runs the quantized matmuls of ``--quantization``
(``model/quant_linear.py`` calls them): which torch op and dtype each device takes, which modes a
device cannot run, and which it runs slower than the unquantized path (the worker warns at
start).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantMatmul:
    """How torch's int8 and fp8 matmuls are called on a device (``model/quant_linear.py`` uses
    them).

    ``weight_only_dtype``: the activation dtype ``aten._weight_int8pack_mm`` runs in. On the CPU
    bf16: its fp32 path is scalar (docs/notes/quantization.md, "Kernels behind quant_linear.py"); on
    CUDA the model's dtype. ``int_mm_min_rows``: ``torch._int_mm`` on CUDA needs more than 16
    rows (fewer are padded with zero rows); the CPU takes any. ``fbgemm``: int8-dynamic
    multiplies through fbgemm (a CPU, and a torch built with it and its fp32-output op: x86),
    else through ``torch._int_mm``. ``fp8_output``: the dtype ``torch._scaled_mm`` returns with
    per-row scales: CUDA's kernels give bf16 only there; the CPU's reference loop gives fp32.
    """

    weight_only_dtype: torch.dtype
    int_mm_min_rows: int
    fbgemm: bool
    fp8_output: torch.dtype


def _torch_has_fbgemm() -> bool:
    return ("fbgemm" in torch.backends.quantized.supported_engines
            and hasattr(torch.ops.quantized, "linear_with_input_q_dq_qweight_dq_output_fp32"))


def quant_matmul(device: torch.device, dtype: torch.dtype) -> QuantMatmul:
    """The quantized matmuls' settings on ``device`` for a model computing in ``dtype``."""
    if device.type == "cuda":  # pragma: no cover - needs a GPU
        half = dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        return QuantMatmul(weight_only_dtype=half, int_mm_min_rows=17, fbgemm=False,
                           fp8_output=torch.bfloat16)
    return QuantMatmul(weight_only_dtype=torch.bfloat16, int_mm_min_rows=1,
                       fbgemm=_torch_has_fbgemm(), fp8_output=torch.float32)


FP8_MIN_CAPABILITY = (8, 9)  # e4m3 tensor cores: Ada (8.9), Hopper (9.0) and later


def quantization_unsupported(device: torch.device, mode: str) -> str | None:
    """Why ``--quantization mode`` cannot run on ``device``, or None. fp8 needs CUDA's e4m3
    tensor cores (compute capability 8.9 or newer); the CPU runs torch's reference loop for it
    (:func:`quantization_slow_here` says what that costs)."""
    if mode != "fp8" or device.type != "cuda":
        return None
    capability = torch.cuda.get_device_capability(device)  # pragma: no cover - needs a GPU
    if capability < FP8_MIN_CAPABILITY:  # pragma: no cover - needs a GPU
        return (f"this GPU is compute capability {capability[0]}.{capability[1]}; fp8 matmuls "
                "need 8.9 or newer (Ada, Hopper, Blackwell): use --quantization int8 or "
                "int8-dynamic")
    return None  # pragma: no cover - needs a GPU


def quantization_slow_here(device: torch.device, mode: str, native: bool = False
                           ) -> str | None:
    """Why ``--quantization mode`` is likely slower than the unquantized path on this device, or
    None. ``native``: the C++ CPU ops are loaded (``--cpu-kernels``).

    fp8 on the CPU is torch's reference loop for ``torch._scaled_mm``, several times slower than
    the fp32 product; it serves there so that its tokens can be checked. The weight-only mode
    (``int8``) runs the C++ op where the CPU ops are loaded (``lorastream/kernels/cpu/int8.py``:
    fp32 activations, no slower than the fp32 product). Without them it takes torch's kernel,
    fast only with AVX-512 (bf16 conversion): on an AVX2-only CPU it decodes slower than the fp32
    path. ``int8-dynamic`` multiplies in int8: fbgemm's AVX2 kernels where torch has fbgemm (x86
    builds), faster than fp32; without fbgemm it runs ``torch._int_mm``, fast only with AVX-512
    VNNI. (measured: docs/notes/quantization.md, "Kernels behind quant_linear.py" and "Which
    mode pays on which CPU")"""
    if device.type != "cpu" or (mode == "int8" and native):
        return None
    if mode == "fp8":
        return ("fp8 matmuls run on CUDA's tensor cores (compute capability 8.9 or newer); on "
                "the CPU torch's reference loop does them, several times slower than fp32: use "
                "this to check the mode's tokens, and --quantization int8-dynamic to serve on "
                "a CPU")
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512"):
        return None
    fbgemm = quant_matmul(device, torch.float32).fbgemm  # the kernel int8-dynamic takes here
    if mode == "int8-dynamic" and fbgemm:
        return None
    hint = (" (--quantization int8-dynamic runs fbgemm's int8 kernels, faster than fp32 here)"
            if fbgemm else "")
    loaded = (" (and the C++ CPU ops, whose int8 product is faster than fp32, are not loaded: "
              "--cpu-kernels)" if mode == "int8" else "")
    return (f"this CPU's best vector extension is {capability} (no AVX-512): the {mode} kernels "
            f"run slower here than the fp32 path{loaded}{hint}; quantization still cuts the "
            "base's resident bytes about 4x")
