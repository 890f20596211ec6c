"""Quantized base weights (``--quantization``): a projection quantized once at load, per output
channel, to int8 or fp8.

Semantics::

    # at load, from the fp32/bf16 checkpoint weight W [N, K]; Q = WEIGHT_QMAX[mode]:
    # 127 for int8, 63 for int8-dynamic (7-bit weights, see "Why 63" below); int8-dynamic
    # first rotates W's rows, W <- rotate(W) (rotation.py: R orthogonal, x Wᵀ = (xR)(WR)ᵀ)
    scale[n] = max_k |W[n, k]| / Q, rounded up to a bf16 value      # [N], 1 where a row is 0
    Wq[n, k] = clamp(round(W[n, k] / scale[n]), -Q, Q)             # [N, K] int8
    dequant(Wq)[n, k] = Wq[n, k] * scale[n]                        # what the model now holds

    # per call, x [T, K] -> y [T, N] (+ bias[n]), returned in x's dtype
    int8 (weight-only):  y[t, n] = sum_k x[t, k] * dequant(Wq)[n, k]
    int8-dynamic:        x <- rotate(x)   (the weight's rotation: the product is unchanged)
                         a[t] = max(max_k |x[t, k]|, 1e-12)
                         xq[t, k] = round(x[t, k] * ((1 / a[t]) * 127))
                         s[t] = a[t] / 127   (fp32; round: half to even)
                         y[t, n] = s[t] * scale[n] * sum_k xq[t, k] * Wq[n, k]   (int32 sums)

    # fp8 (e4m3 weights and activations, F = 448, e4m3's largest finite value)
    scale[n] = max_k |W[n, k]| / F   (fp32; 1 where a row is 0)
    Wq[n, k] = e4m3(W[n, k] / scale[n])          # [N, K] float8_e4m3fn, round to nearest even
    per call: s[t] = max_k |x[t, k]| / F;  xq[t, k] = e4m3(x[t, k] / s[t])
              y[t, n] = s[t] * scale[n] * sum_k xq[t, k] * Wq[n, k]   (fp32 sums)

The LoRA delta is not part of this: the decoder adds it, in the adapter's precision, into ``y``
(the dequantized product), exactly as over the fp32 projection.

**fp8** is vLLM's dynamic fp8 (per-token activation scales, per-channel weight scales): one
``torch._scaled_mm`` per projection on CUDA's e4m3 tensor cores (compute capability 8.9 and
newer, twice bf16's multiply rate), bf16 out (what its per-row scales give there). Where K or N
is not a multiple of 16 (CUDA's kernels need both) the same sums run as an fp32 product over
the dequantized weight. e4m3 keeps 3 mantissa bits: each weight and activation within 2^-4 of
its value, so its logits move more than int8-dynamic's (``LOGIT_TOLERANCE``). The CPU has no
fp8 kernel: torch's ``_scaled_mm`` there is a reference loop, several times slower than the
fp32 product, that computes the same sums, so the mode's tokens are tested on
every machine (tests/worker/model/test_quantization.py) and its speed by ``make test-gpu``.

The model's weight in the checkpoint's basis (what the reference computes with) is
``dequant(Wq)``, un-rotated for int8-dynamic: :func:`dequantized_weight`.

**int8 on the CPU's C++ op.** Where the C++ CPU ops are loaded (``--cpu-kernels``; fp32 on the
CPU), int8 runs ``lorastream/kernels/cpu/int8.py``'s op over the weight packed once at load in
blocks of 16 channels (the only copy): fp32 activations, so its product is the dequantized one to
fp32 rounding; it reads a quarter of fp32's bytes, which is what decoding waits on (measured:
docs/notes/quantization.md, "Kernels behind quant_linear.py"). Elsewhere (CUDA; torch's CPU
paths) the kernels below.

**The lm_head's candidates, exact (int8 on torch's kernel, int8-dynamic).** The bf16 kernel
rounds activations and outputs to 8 significant bits, which moves a logit by a fraction of a
percent of the row's largest. At the lm_head that decides greedy tokens, so ``exact_top`` recomputes
the ``EXACT_TOP`` largest logits of each row as the fp32 product over the dequantized rows (what the
reference computes) and puts them back::

    top = the EXACT_TOP largest y[t, :]
    y[t, v] = sum_k x[t, k] * dequant(Wq)[v, k] (+ bias[v])    for v in top (fp32)

The argmax is then the reference's wherever the reference's best token is among the kernel's top
EXACT_TOP (within the tolerance it is): as many greedy tokens agree with the reference as with
the whole lm_head computed exactly. int8-dynamic's lm_head rounds its activations instead, and
the same recomputation (over the rotated rows and input) takes that rounding out of its
candidates' logits (measured: docs/notes/quantization.md, "Kernels behind quant_linear.py"). Cost: a
topk over the vocabulary and EXACT_TOP rows per token; the lm_head keeps its int8 rows beside
fbgemm's packed copy. The C++ op's product needs none of it (``exact_top`` returns it as it is).

**Why 63 for int8-dynamic.** x86's int8 dot product without VNNI (AVX2's ``vpmaddubsw``, what
fbgemm runs there) multiplies unsigned 8-bit activations by signed 8-bit weights and adds each
pair into a *saturating* int16: 2 * 255 * 127 overflows it, 2 * 255 * 63 = 32130 does not. 7-bit
weights keep every sum exact with 8-bit activations on every CPU; the same weights on CUDA and
VNNI CPUs keep the mode's tokens the same everywhere. Against the dequantized reference, 7-bit
weights cost about what 8 bits did, while 7-bit activations cost more (measured:
docs/notes/quantization.md, "Kernels behind quant_linear.py").

The kernels, on the CPU (their timings: docs/notes/quantization.md, "Kernels behind
quant_linear.py"):

- ``aten._weight_int8pack_mm`` with **bf16** activations (fp32 accumulation, bf16 output) is the
  fastest weight-only kernel at one row, where decoding reads weights (bandwidth-bound), but it
  works row by row and falls behind fp32 from a few rows on. With fp32 activations it is scalar:
  never used. It needs K a multiple of 16 (other K crashed or gave wrong sums): other K take the
  exact dequantize-then-matmul path.
- Dequantizing on the fly (``x @ (Wq * scale).T``) writes an fp32 copy per call: slowest.
- ``torch._int_mm`` (VNNI int8 dot products) beats the fp32 path at 32 rows, but needs int8
  activations: the ``int8-dynamic`` mode, whose per-token activation rounding is a second error.
- On an AVX2-only CPU (``_int_mm`` there is a reference loop) the dynamic mode runs fbgemm:
  ``quantized.linear_with_input_q_dq_qweight_dq_output_fp32`` on the prepacked 7-bit weight,
  given xq (integers, scale 1, zero point 128: the u8 it multiplies is xq + 128), so its int32
  sums are ours and ``s[t]`` is applied after. Weight-only int8 cannot beat fp32 there at 32
  rows: the fp32 product already runs near the FMA peak, and converting int8 weights costs
  instructions on top of the same FMAs. fbgemm is reached through torch's quantized-tensor API,
  which torch deprecates; where it is missing (not an x86 build, a future torch) the mode takes
  ``_int_mm``, same sums.
- oneDNN's ``torch.ops.onednn.qlinear_pointwise`` (static scales, a prepacked u8/s8 pair) was no
  faster than fp32 on an AVX2 CPU; not used.

Which dtype and padding each kernel needs on CUDA is the device layer's
(:func:`~lorastream.worker.device.quant_matmul.quant_matmul`).
"""

from __future__ import annotations

import logging
import warnings
from typing import Literal

import torch

from lorastream.kernels.cpu.int8 import int8_weight_mm, packed_rows
from lorastream.kernels.cpu.int8 import pack as pack_int8
from lorastream.kernels.cpu.int8 import unpack as unpack_int8
from lorastream.worker.device.quant_matmul import quant_matmul
from lorastream.worker.model.rotation import Rotation, rotation

log = logging.getLogger(__name__)

Quantization = Literal["none", "int8", "int8-dynamic", "fp8"]
QUANTIZATIONS: tuple[str, ...] = ("none", "int8", "int8-dynamic", "fp8")
MODES: tuple[str, ...] = QUANTIZATIONS[1:]  # the quantized ones

# The stated tolerance per token against transformers + PEFT over the dequantized weights:
# max |logit - reference logit| <= LOGIT_TOLERANCE[mode] * max |reference logit| of that row
# (tests/worker/model/test_quantization.py; the worst each mode measured: docs/notes/
# quantization.md, "Kernels behind quant_linear.py"). int8's is torch's kernel's (bf16
# activations); the CPU's C++ op (fp32 activations) stays far within it. A position whose
# reference top-2 margin is within it is a near-tie: either token may win there.
LOGIT_TOLERANCE = {"int8": 0.03, "int8-dynamic": 0.08, "fp8": 0.6}

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
_ACT_QMAX = 127  # int8-dynamic's activations: 8 bits per token
WEIGHT_QMAX = {"int8": 127, "int8-dynamic": 63}  # see "Why 63 for int8-dynamic"
_U8_ZERO = 128  # fbgemm reads xq + 128 as its unsigned activation
_K_MULTIPLE = 16  # _weight_int8pack_mm's K (see the module docstring)
_ROWS_PER_CHUNK = 4096  # quantize this many rows at once: bounds the fp32 temporaries
EXACT_TOP = 8  # the lm_head's logits recomputed exactly per row (see the module docstring)


def quantize_int8(
    weight: torch.Tensor, qmax: int = 127, rotated: Rotation | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``W [N, K]`` -> ``(Wq [N, K] int8, scale [N] fp32)``, per output channel, symmetric, with
    ``|Wq| <= qmax``; of ``rotated.rotate(W)`` if ``rotated`` is given.

    Each scale is rounded up to a bf16 value, so that the bf16 kernels and the fp32 reference
    multiply by the same number, and no |W| / scale exceeds ``qmax``.
    """
    n = weight.shape[0]
    wq = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)  # [N, K]
    scale = torch.empty(n, dtype=torch.float32, device=weight.device)  # [N]
    for start in range(0, n, _ROWS_PER_CHUNK):
        w = weight[start : start + _ROWS_PER_CHUNK].float()  # [n', K]
        if rotated is not None:
            w = rotated.rotate(w)
        exact = w.abs().amax(dim=1) / qmax  # [n']
        s = (exact * (1 + 2**-7)).to(torch.bfloat16).float()  # bf16, >= exact
        s = torch.where(exact > 0, s, torch.ones_like(s))
        wq[start : start + _ROWS_PER_CHUNK] = torch.round(w / s[:, None]).clamp_(-qmax, qmax)
        scale[start : start + _ROWS_PER_CHUNK] = s
    return wq, scale


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``W [N, K]`` -> ``(Wq [N, K] float8_e4m3fn, scale [N] fp32)``, per output channel, each
    row's largest |W| at e4m3's largest value (module docstring)."""
    wq = torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device=weight.device)  # [N, K]
    scale = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)  # [N]
    for start in range(0, weight.shape[0], _ROWS_PER_CHUNK):
        w = weight[start : start + _ROWS_PER_CHUNK].float()  # [n', K]
        exact = w.abs().amax(dim=1) / FP8_MAX  # [n']
        s = torch.where(exact > 0, exact, torch.ones_like(exact))
        wq[start : start + _ROWS_PER_CHUNK] = (w / s[:, None]).clamp_(-FP8_MAX, FP8_MAX)
        scale[start : start + _ROWS_PER_CHUNK] = s
    return wq, scale


def input_rotation(mode: str, k: int, device: torch.device) -> Rotation | None:
    """The rotation ``mode`` applies to inputs of size ``k`` (rotation.py): int8-dynamic's."""
    return rotation(k, device) if mode == "int8-dynamic" else None


def quantize(weight: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``W [N, K]`` -> ``(Wq [N, K], scale [N])`` as ``mode`` holds the weight (int8-dynamic's
    rotated)."""
    if mode == "fp8":
        return quantize_fp8(weight)
    return quantize_int8(weight, WEIGHT_QMAX[mode],
                         input_rotation(mode, weight.shape[1], weight.device))


def dequantized_weight(weight: torch.Tensor, mode: str) -> torch.Tensor:  # [N, K] -> [N, K]
    """The fp32 weight ``mode`` computes with in place of ``weight``, in the checkpoint's basis:
    what transformers + PEFT hold for the reference the tolerances are stated against."""
    held = dequantize(*quantize(weight, mode))  # [N, K]
    rotated = input_rotation(mode, weight.shape[1], weight.device)
    return held if rotated is None else rotated.undo(held)


def dequantize(wq: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``Wq [N, K] (int8 or e4m3), scale [N]`` -> the fp32 weight [N, K] the quantized model
    computes with."""
    return wq.float() * scale[:, None]


def _fbgemm_prepack(wq: torch.Tensor, scale: torch.Tensor) -> object | None:
    """fbgemm's prepacked form of ``Wq`` with its per-channel scales (where the device layer says
    fbgemm is there: ``QuantMatmul.fbgemm``), or None if torch refuses to pack it."""
    try:
        with warnings.catch_warnings():  # the quantized-tensor API's deprecation notice
            warnings.simplefilter("ignore")
            qweight = torch._make_per_channel_quantized_tensor(
                wq, scale.double(), torch.zeros(wq.shape[0], dtype=torch.long), 0)
            return torch.ops.quantized.linear_prepack(qweight, None)
    except (RuntimeError, AttributeError) as err:  # a build without it: _int_mm does the same
        log.debug("no fbgemm prepacking for a %s weight: %s", list(wq.shape), err)
        return None


class QuantLinear:
    """A projection over int8 or fp8 weights: ``linear(x)`` for x [T, K] -> [T, N] (module
    docstring's Semantics)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None,
        mode: Quantization = "int8", keep_rows: bool = False, native: bool = False,
    ) -> None:
        """``keep_rows``: rows of the matrix are read every step (the lm_head's: ``exact_top``,
        a tied head's embedding lookup), so the int8 matrix stays held even where fbgemm keeps
        its own packed copy. ``native``: the C++ CPU ops are loaded (``--cpu-kernels``):
        int8-dynamic's rotation runs on them."""
        if mode not in MODES:
            raise ValueError(f"QuantLinear mode {mode!r}: one of {', '.join(MODES)}")
        self.mode = mode
        self.out_features, self.in_features = weight.shape
        # [N, K] int8 or e4m3 (None once fbgemm holds the only copy), [N] fp32
        self._held: torch.Tensor | None
        self._held, self.scale = quantize(weight, mode)
        self.rotation = input_rotation(mode, self.in_features, weight.device)
        self._native = native
        self.bias = bias  # [N] or None
        self._plan = quant_matmul(weight.device, weight.dtype)
        self._scale_kernel = (self.scale[None, :] if mode == "fp8"  # [1, N] _scaled_mm's
                              else self.scale.to(self._plan.weight_only_dtype))  # [N] int8pack's
        # int8 on the CPU's C++ op: the only copy, in its blocks of 16 channels (cpu_int8.py)
        self._packed: torch.Tensor | None = None  # [ceil(N / 16), K, 16] int8
        if mode == "int8" and native and weight.device.type == "cpu":
            self._packed, self._held = pack_int8(self._held), None
        # torch's kernels: int8pack needs K % 16 == 0, _scaled_mm K and N; the dynamic mode's
        # _int_mm reads Wqᵀ as a strided view (the C++ op takes any K and N)
        self._exact = self._packed is None and (
            (mode == "int8" and self.in_features % _K_MULTIPLE != 0) or (
                mode == "fp8"
                and (self.in_features % _K_MULTIPLE or self.out_features % _K_MULTIPLE)))
        if self._exact:
            log.debug("%s weight %s: K or N is not a multiple of %d: dequantize-then-matmul",
                      mode, [self.out_features, self.in_features], _K_MULTIPLE)
        held = self._held  # int8-dynamic never packs: its weight is still held here
        self._fbgemm = (_fbgemm_prepack(held, self.scale)
                        if mode == "int8-dynamic" and self._plan.fbgemm and held is not None
                        else None)
        if self._fbgemm is not None and not keep_rows:
            self._held = None  # fbgemm's packed copy is the one the product reads

    @property
    def weight_q(self) -> torch.Tensor:  # [N, K] int8 or e4m3
        """``Wq``: the held matrix, or (fbgemm or the C++ op holding the only copy) unpacked
        from theirs, a full copy per call: for references and tests, not for a step."""
        if self._held is not None:
            return self._held
        if self._packed is not None:
            return unpack_int8(self._packed, self.out_features)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qweight, _ = torch.ops.quantized.linear_unpack(self._fbgemm)
            return qweight.int_repr()

    @property
    def kernel(self) -> str:
        """The op the product runs on (what the module docstring's tables compare)."""
        if self.mode == "int8-dynamic":
            return "fbgemm" if self._fbgemm is not None else "int_mm"
        if self._packed is not None:
            return "int8_weight_mm"
        if self._exact:
            return "dequantize"
        return "scaled_mm" if self.mode == "fp8" else "int8pack"

    @property
    def nbytes(self) -> int:
        """Bytes of one int8 (or e4m3) copy of the weight and its scales (bias not counted;
        where fbgemm's packed copy and the held matrix are both kept, the lm_head, twice the
        first term)."""
        return self.out_features * self.in_features + 4 * self.scale.numel()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, K] fp32
        """Dequantized rows ``ids`` of the weight in the checkpoint's basis: the embedding lookup
        of a tied lm_head."""
        rows = self._rows_q(ids).float() * self.scale[ids, None]  # [T, K]
        return rows if self.rotation is None else self.rotation.undo(rows, self._native)

    def dequantized(self) -> torch.Tensor:  # [N, K] fp32
        """The whole weight as :meth:`rows` gives rows: for references and tests."""
        return self.rows(torch.arange(self.out_features, device=self.scale.device))

    def delta_row_norms(
        self, rows: slice, b: torch.Tensor, a: torch.Tensor
    ) -> torch.Tensor:  # b [n, r], a [r, K] -> [n] fp32
        """``||dequant(Wq)[rows] + b @ a||`` per output row (DoRA's weight norm) over the
        dequantized weight in the checkpoint's basis, the weight this mode computes with
        (:meth:`rows`), in fp32."""
        ids = torch.arange(rows.start, rows.stop, device=self.scale.device)  # [n]
        return (self.rows(ids) + b.float() @ a.float()).norm(dim=1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        if x.shape[0] == 0:
            return x.new_empty((0, self.out_features))
        if self.mode == "int8-dynamic":
            y = self._dynamic(x)
        elif self.mode == "fp8":
            y = self._fp8(x)
        elif self._packed is not None:
            y = int8_weight_mm(x.float().contiguous(), self._packed, self.scale)  # [T, N]
        elif self._exact:
            y = x.float() @ dequantize(self.weight_q, self.scale).T  # [T, N]
        else:
            act = x.to(self._plan.weight_only_dtype)  # [T, K]
            y = torch.ops.aten._weight_int8pack_mm(act, self.weight_q, self._scale_kernel)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y

    def exact_top(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # -> [T, N]
        """``y = self(x)`` with each row's ``EXACT_TOP`` largest entries recomputed in fp32 over
        the dequantized weight (module docstring); fp8, and int8 on the C++ op (whose product
        is that already), return ``y`` as it is."""
        if self.mode == "fp8" or self._packed is not None or y.shape[0] == 0:
            return y
        top = y.topk(min(EXACT_TOP, self.out_features), dim=1).indices  # [T, k]
        rows = self._rows_q(top).float() * self.scale[top, None]  # [T, k, K] (held basis)
        x32 = x.float()  # [T, K]
        if self.rotation is not None:
            x32 = self.rotation.rotate(x32, self._native)
        exact = torch.bmm(rows, x32[:, :, None])[:, :, 0]  # [T, k]
        if self.bias is not None:
            exact = exact + self.bias[top].float()
        return y.scatter(1, top, exact.to(y.dtype))

    def _rows_q(self, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., K] int8 or e4m3
        """Rows ``ids`` of ``Wq``, without a whole copy."""
        if self._packed is not None:
            return packed_rows(self._packed, ids)
        return self.weight_q[ids]

    def _fp8(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        x32 = x.float()
        amax = x32.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12)  # [T, 1]
        s = amax / FP8_MAX  # [T, 1] fp32
        xq = (x32 / s).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # [T, K]
        if self._exact:
            return (xq.float() @ dequantize(self.weight_q, self.scale).T).mul_(s)  # [T, N]
        return torch._scaled_mm(xq, self.weight_q.T, scale_a=s, scale_b=self._scale_kernel,
                                out_dtype=self._plan.fp8_output)  # [T, N]

    def _dynamic(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N] fp32
        assert self.rotation is not None
        # [T, K] in [-127, 127] (rounded below), [T, 1]: the rotated input over its step
        scaled, s = self.rotation.rotate_scaled(x.float(), _ACT_QMAX, self._native)
        if self._fbgemm is not None:
            # fbgemm rounds ``scaled`` (scale 1, zero point 128: round half to even, as
            # torch.round), sums (xq + 128) * Wq in int32 minus 128 * sum_k Wq, and multiplies by
            # scale[n]; each op here costs as much as a small product, so none is spent on rounding
            y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
                scaled, 1.0, _U8_ZERO, self._fbgemm)  # [T, N] fp32
            return y.mul_(s)
        xq8 = scaled.round_().to(torch.int8)  # [T, K]
        t = xq8.shape[0]
        if t < self._plan.int_mm_min_rows:  # CUDA's _int_mm: more than 16 rows
            xq8 = torch.cat([xq8, xq8.new_zeros(self._plan.int_mm_min_rows - t, xq8.shape[1])])
        acc = torch._int_mm(xq8, self.weight_q.T)[:t]  # [T, N] int32
        return acc * s * self.scale
