"""``--quantization int8`` / ``int8-dynamic`` / ``fp8``: the quantizers, the quantized
projection, and every model family against transformers + PEFT over the *dequantized* weights.

Exact identity with PEFT is impossible on a quantized base, so the reference is HF with every
``nn.Linear`` weight (the lm_head included; a tied embedding with it) replaced by
``dequant(quant(W))`` — the weights the worker computes with — and PEFT on top. What remains is
the kernels' arithmetic: on the CPU ``int8`` runs fp32 activations on the C++ op where the CPU
ops load (``OP_INT8_BOUND``), else torch's kernel's bf16 activations with a bf16 output,
``int8-dynamic`` (7-bit weights) also rounds each token's activations to int8, ``fp8`` to e4m3
(torch's reference ``_scaled_mm`` on the CPU: the sums CUDA's kernels compute). Stated
tolerances, fixed in this file, per token:

- logits: ``max |Δ| <= LOGIT_BOUND[mode] * max |logit|`` of that token's reference row, and the
  95th percentile of that ratio over all rows within ``LOGIT_BOUND_P95[mode]``;
- greedy tokens, teacher-forced (every position sees the reference's prefix, so one near-tie
  does not derail the rest of a sequence), over ONE mixed batch of the base model and three
  adapters (ranks 4, 8, 16 rsLoRA; attention, MLP and all-linear targets): the argmax equals the
  reference's at >= 99% of the *decisive* positions, those whose reference top-2 margin exceeds
  ``DECISIVE_MARGIN[mode]`` of the row's largest |logit| (at least ``MIN_DECISIVE_SHARE`` of the
  positions, so the check is never vacuous), and at >= MIN_RAW_AGREEMENT of all.

Measured on these tiny random models (near-flat logits over 256 tokens: many near-ties), worst
family per mode: int8 on the C++ op max |Δ| 1.1e-5 of max |logit|, every position equal; on
torch's kernel 2.4%, raw agreement 97.6% (246/252, qwen2);
int8-dynamic (7-bit weights, 8-bit activations of the rotated input) 6.0% (qwen2; 22% in llama
before the rotation), raw 95.6% (241/252, phi3), every one of 107-169 decisive positions per
family; fp8 (e4m3 weights and activations: 3 mantissa bits) 54% in one llama row but a 95th
percentile of 8.5-13%, raw 86.4% (216/250, llama), and at a 15% margin every one of 55-114
decisive positions per family (at 10%, 97/98 in llama). ``bench engine --quantization int8``
reports the same two figures on the default model against the fp32 engine: all teacher-forced
positions, and the decisive ones by this criterion (reference logits from transformers + PEFT in
fp32).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorastream.worker.device.device import Device
from lorastream.worker.loading.adapter import adapter_weights
from lorastream.worker.loading.fetch import AdapterFetcher
from lorastream.worker.lora.backend import LoraStep, TorchLoraBackend
from lorastream.worker.lora.slots import LoraSlots
from lorastream.worker.model import quant_linear
from lorastream.worker.model.config import ModelConfig
from lorastream.worker.model.decoder import DecoderModel
from lorastream.worker.model.forward_batch import ForwardBatch, PrefillSpan
from lorastream.worker.model.kv_cache import KVCache, slot_mapping
from lorastream.worker.model.linear import Linear
from lorastream.worker.model.quant_linear import (
    EXACT_TOP,
    WEIGHT_QMAX,
    QuantLinear,
    dequantize,
    dequantized_weight,
    quantize,
    quantize_fp8,
    quantize_int8,
)
from lorastream.worker.model.rotation import rotation
from lorastream.worker.model.weights import load_weights
from tests.support.families import BASE, NEW_TOKENS, PROMPTS, adapter_specs
from tests.support.logit_agreement import logit_agreement
from tests.support.models import (
    EXPERT_PARAMETERS,
    FAMILY_CONFIGS,
    MOE_CONFIGS,
    make_expert_adapter,
    make_family_adapter,
    make_tiny_family,
)
from tests.worker.conftest import EngineFactory

MODES = ["int8", "int8-dynamic", "fp8"]
# The stated tolerances, fixed here (not read from the code under test, so loosening the product
# does not loosen the test). Per token, against transformers + PEFT over the dequantized weights:
# the worst row's max |Δlogit| / max |logit|, and the 95th percentile of that ratio over all rows.
LOGIT_BOUND = {"int8": 0.03, "int8-dynamic": 0.08, "fp8": 0.6}
LOGIT_BOUND_P95 = {"int8": 0.03, "int8-dynamic": 0.08, "fp8": 0.15}
# A position is decisive when its reference top-2 margin exceeds this share of its largest
# |logit| (above the mode's typical error, so the argmax there must not move).
DECISIVE_MARGIN = {"int8": 0.03, "int8-dynamic": 0.08, "fp8": 0.15}
MIN_DECISIVE_AGREEMENT = 0.99
MIN_DECISIVE_SHARE = 0.15  # the decisive check covers at least this share of the positions
# int8 on the C++ op (lorastream/kernels/cpu/int8.py): fp32 activations, the reference's product
# summed in another order (measured worst 1.1e-5, every position equal in every family)
OP_INT8_BOUND = 1e-4
OP_INT8_RAW_AGREEMENT = 0.99
MIN_RAW_AGREEMENT = {"int8": 0.97, "int8-dynamic": 0.94, "fp8": 0.85}


# -- the quantizer and the projection ----------------------------------------------------------
@pytest.mark.parametrize("qmax", [127, 63])  # int8's and int8-dynamic's (WEIGHT_QMAX)
@pytest.mark.parametrize("shape", [(96, 64), (7, 577), (4100, 32)], ids=str)
def test_quantize_is_per_channel_symmetric_and_within_half_a_step(
    shape: tuple[int, int], qmax: int
) -> None:
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.logspace(-3, 1, shape[0])[:, None]  # rows of every scale
    w[1] = 0.0  # an all-zero row
    wq, scale = quantize_int8(w, qmax)
    assert wq.dtype == torch.int8 and wq.shape == w.shape and scale.shape == (shape[0],)
    assert int(wq.abs().max()) <= qmax
    assert torch.equal(scale, scale.bfloat16().float())  # the bf16 kernels' scales exactly
    assert bool((wq[1] == 0).all())
    err = (dequantize(wq, scale) - w).abs()  # [N, K]
    assert bool((err <= scale[:, None] / 2 * (1 + 1e-6)).all())
    used = wq.abs().amax(dim=1)[w.abs().amax(dim=1) > 0]  # [N'] the range is used
    assert bool((used >= qmax - 3).all())


@pytest.mark.parametrize("shape", [(96, 64), (7, 577), (4100, 32)], ids=str)
def test_quantize_fp8_is_per_channel_and_rounds_to_the_nearest_e4m3_value(
    shape: tuple[int, int],
) -> None:
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.logspace(-3, 1, shape[0])[:, None]  # rows of every scale
    w[1] = 0.0  # an all-zero row
    wq, scale = quantize_fp8(w)
    assert wq.dtype == torch.float8_e4m3fn and wq.shape == w.shape and scale.shape == (shape[0],)
    assert torch.equal(quantize(w, "fp8")[0].float(), wq.float())
    assert float(wq.float().abs().max()) <= 448 and bool((wq[1].float() == 0).all())
    used = wq.float().abs().amax(dim=1)[w.abs().amax(dim=1) > 0]  # [N'] each row reaches 448
    assert bool((used == 448).all())
    # e4m3: 3 mantissa bits, so within 2^-4 of each value; below 2^-6 (subnormal) steps of 2^-9
    err = (dequantize(wq, scale) - w).abs()  # [N, K]
    bound = torch.maximum(w.abs() * 2**-4, scale[:, None] * 2**-10)
    assert bool((err <= bound * (1 + 1e-6)).all())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows", [0, 1, 5, 32])
@pytest.mark.parametrize("k", [64, 96, 72], ids=lambda k: f"K{k}")  # 72: not a multiple of 16
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_quant_linear_matches_the_dequantized_product(
    mode: str, rows: int, k: int, bias: bool
) -> None:
    torch.manual_seed(1)
    w, x = torch.randn(48, k) * 0.1, torch.randn(rows, k)
    b = torch.randn(48) if bias else None
    linear = QuantLinear(w, b, mode)  # type: ignore[arg-type]  # mode: a str from the parametrize list
    expected = x @ linear.dequantized().T  # [T, N]
    if b is not None:
        expected = expected + b
    y = linear(x)
    assert y.shape == (rows, 48) and y.dtype == torch.float32
    torch.testing.assert_close(linear.dequantized(), dequantized_weight(w, mode))
    if rows:
        bound = {"int8": 1e-2, "int8-dynamic": 3e-2, "fp8": 8e-2}[mode]
        assert float((y - expected).abs().max()) <= bound * float(expected.abs().max())
    assert linear.nbytes == 48 * k + 4 * 48  # a quarter of fp32's 4 * 48 * k, plus scales
    if mode == "fp8":  # torch._scaled_mm where K and N are multiples of 16
        assert linear.kernel == ("dequantize" if k % 16 else "scaled_mm")


@pytest.mark.parametrize("rows", [1, 5, 32])
@pytest.mark.parametrize("k", [64, 72], ids=lambda k: f"K{k}")  # 72: the dequantize path
def test_fp8_computes_its_semantics_sums(rows: int, k: int) -> None:
    """Per-token e4m3 activations (largest |x| at 448) times the e4m3 weights, fp32 sums, both
    scales after: the module docstring's Semantics, written out in float64."""
    torch.manual_seed(3)
    w, x = torch.randn(48, k) * 0.1, torch.randn(rows, k) * torch.logspace(-2, 2, rows)[:, None]
    linear = QuantLinear(w, None, "fp8")
    s = x.abs().amax(dim=1, keepdim=True) / 448  # [T, 1]
    xq = (x / s).to(torch.float8_e4m3fn).double()  # [T, K]
    assert float(xq.abs().max()) == 448
    expected = (xq @ linear.weight_q.double().T) * s.double() * linear.scale.double()  # [T, N]
    y = linear(x)
    assert float((y.double() - expected).abs().max()) <= 1e-5 * float(expected.abs().max())
    assert not torch.allclose(y, x @ w.T, rtol=1e-3)  # the rounding is there: it is fp8


@pytest.mark.parametrize("mode", ["int8", "int8-dynamic"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_exact_top_recomputes_each_rows_candidates_over_the_dequantized_weight(
    bias: bool, mode: str,
) -> None:
    """The lm_head's EXACT_TOP largest logits per row become the fp32 product over the
    dequantized weight (int8-dynamic's un-rotated); the rest stay the kernel's; fp8's are left
    as they are."""
    torch.manual_seed(2)
    w, x = torch.randn(300, 64) * 0.1, torch.randn(5, 64)
    b = torch.randn(300) if bias else None
    linear = QuantLinear(w, b, mode, keep_rows=True)  # type: ignore[arg-type]  # mode: a str from the parametrize list
    expected = x @ linear.dequantized().T  # [T, N]
    if b is not None:
        expected = expected + b
    y = linear(x)
    exact = linear.exact_top(x, y)
    top = y.topk(EXACT_TOP, dim=1).indices  # [T, k]
    torch.testing.assert_close(exact.gather(1, top), expected.gather(1, top), rtol=1e-6,
                               atol=1e-5)
    others = torch.ones_like(y, dtype=torch.bool).scatter_(1, top, False)
    assert torch.equal(exact[others], y[others])
    assert not torch.equal(exact, y)  # the kernel's rounding was there to take out
    assert torch.equal(exact.argmax(1), expected.argmax(1))
    fp8 = QuantLinear(w, b, "fp8")
    y_fp8 = fp8(x)
    assert fp8.exact_top(x, y_fp8) is y_fp8


def _integer_reference(linear: QuantLinear, x: torch.Tensor) -> torch.Tensor:  # [T, N]
    """The dynamic mode's Semantics in float64: rotated, per-token 8-bit activations, exact
    sums."""
    assert linear.rotation is not None
    x = linear.rotation.rotate(x)  # [T, K]
    amax = x.abs().amax(dim=1, keepdim=True)  # [T, 1]
    xq = torch.round(x * (127 / amax)).double()  # [T, K], rounded in fp32 as the Semantics say
    return (amax / 127).double() * (xq @ linear.weight_q.double().T) * linear.scale.double()


@pytest.mark.parametrize("kernel", ["fbgemm", "int_mm"])
@pytest.mark.parametrize("case", ["random", "saturating"])
def test_the_dynamic_mode_sums_exactly_on_every_kernel(
    kernel: str, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both CPU kernels compute the Semantics' int32 sums exactly. "saturating": every activation
    at +-127 against every weight at the 7-bit limit of its sign (in the rotated basis the mode
    multiplies in: x and W are those values un-rotated), the sums AVX2's int16 pair adds would
    overflow with 8-bit weights (2 * 255 * 127 > 32767): fbgemm must still be exact."""
    if kernel == "fbgemm" and "fbgemm" not in torch.backends.quantized.supported_engines:
        pytest.skip("this torch build has no fbgemm (not x86): int8-dynamic runs _int_mm")
    torch.manual_seed(2)
    w, x = torch.randn(96, 576) * 0.05, torch.randn(9, 576)
    if case == "saturating":
        rotated = rotation(576, torch.device("cpu"))
        signs_w = torch.where(torch.arange(96)[:, None] % 2 == 0, 1.0, -1.0).expand(96, 576)
        signs_x = torch.where(torch.arange(9)[:, None] % 3 == 0, -1.0, 1.0).expand(9, 576)
        w, x = rotated.undo(signs_w), rotated.undo(signs_x)
    if kernel == "int_mm":  # the path a torch without fbgemm takes
        monkeypatch.setattr(quant_linear, "_fbgemm_prepack", lambda wq, scale: None)
    linear = QuantLinear(w, None, "int8-dynamic")
    assert linear.kernel == kernel
    assert int(linear.weight_q.abs().max()) == WEIGHT_QMAX["int8-dynamic"] == 63
    if case == "saturating":
        assert bool((linear.weight_q.abs() == 63).all())
    expected = _integer_reference(linear, x)  # [T, N] float64
    y = linear(x)
    assert float((y.double() - expected).abs().max()) <= 1e-5 * float(expected.abs().max())


@pytest.mark.skipif("fbgemm" not in torch.backends.quantized.supported_engines,
                    reason="this torch build has no fbgemm (not x86): int8-dynamic runs _int_mm")
@pytest.mark.parametrize("family", ["qwen3", "llama"])  # a tied lm_head, and an untied one
def test_fbgemm_holds_the_only_int8_copy_except_the_lm_heads_rows(
    tmp_path: Path, family: str
) -> None:
    checkpoint = make_tiny_family(family, tmp_path / "m")
    config = ModelConfig.from_dir(checkpoint)
    cpu = torch.device("cpu")
    weights = load_weights(checkpoint, config, torch.float32, cpu)
    expected = quantize(weights.layers[0].wqkv, "int8-dynamic")[0]  # [N, K]
    model = DecoderModel(config, weights, cpu, "int8-dynamic")
    for layer in model.proj:
        assert all(p.kernel == "fbgemm" and p._held is None for p in layer)  # type: ignore[union-attr]  # QuantLinear projections
    assert torch.equal(model.proj[0][0].weight_q, expected)  # unpacked from fbgemm's copy
    assert isinstance(model.lm_head, QuantLinear)
    assert model.lm_head._held is not None  # exact_top's rows (and a tied head's lookup)


def test_an_int8_model_holds_a_quarter_of_the_fp32_projection_bytes(tmp_path: Path) -> None:
    checkpoint = make_tiny_family("qwen3", tmp_path / "m")  # tied: the lookup reads the int8
    config = ModelConfig.from_dir(checkpoint)
    cpu = torch.device("cpu")
    model = DecoderModel(config, load_weights(checkpoint, config, torch.float32, cpu), cpu, "int8")
    projections = [p for layer in model.proj for p in layer] + [model.lm_head]
    assert all(isinstance(p, QuantLinear) for p in projections)
    fp32 = sum(4 * p.in_features * p.out_features for p in projections)
    int8 = sum(p.nbytes for p in projections)  # type: ignore[union-attr]  # QuantLinear projections
    assert int8 < fp32 / 3.7  # a quarter, plus one fp32 scale per row of K = 64 bytes
    assert model.weights.embed is None and model.weights.lm_head is None  # no fp32 copy kept
    plain = DecoderModel(config, load_weights(checkpoint, config, torch.float32, cpu), cpu)
    assert all(isinstance(p, Linear) for layer in plain.proj for p in layer)


# -- every family against transformers + PEFT over the dequantized weights ----------------------
def _dequantized_reference(checkpoint: Path, adapter: Path | None, mode: str) -> torch.nn.Module:
    """HF + PEFT over the weights the worker quantizes, dequantized: every ``nn.Linear`` but a
    MoE block's shared-expert gate (the worker keeps it, its router and experts in fp32)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and not name.endswith("shared_expert_gate"):
                module.weight.copy_(dequantized_weight(module.weight, mode))  # lm_head too
    return model if adapter is None else PeftModel.from_pretrained(model, adapter).eval()


def _reference(checkpoint: Path, adapter: Path | None, mode: str) -> dict[int, tuple[list[int],
                                                                                     torch.Tensor]]:
    """prompt -> (prompt + the reference's greedy tokens, its logits at every position [S, V])."""
    model = _dequantized_reference(checkpoint, adapter, mode)
    found = {}
    with torch.no_grad():
        for i, prompt in enumerate(PROMPTS):
            out = model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                dtype=torch.long), max_new_tokens=NEW_TOKENS, do_sample=False,
            )
            sequence = out[0].tolist()
            found[i] = (sequence, model(torch.tensor([sequence])).logits[0])
    return found


Reference = dict[tuple[str, int], tuple[list[int], torch.Tensor]]


@pytest.fixture(scope="module", params=list(FAMILY_CONFIGS))
def family_case(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, Path], dict[str, Reference]]:
    """(checkpoint, adapters, per mode: (name, prompt) -> (prompt + the reference's greedy
    tokens, the reference's logits at every position [S, V])), the reference holding that mode's
    dequantized weights."""
    family, root = request.param, tmp_path_factory.mktemp(request.param)
    checkpoint = make_tiny_family(family, root / "model")
    adapters = {
        name: make_family_adapter(checkpoint, root / name, **spec)  # type: ignore[arg-type]  # spec: the function's own keywords
        for name, spec in adapter_specs(family).items()
    }
    references: dict[str, Reference] = {mode: {} for mode in MODES}
    for mode, name in ((mode, name) for mode in MODES for name in [BASE, *adapters]):
        for i, found in _reference(checkpoint, adapters.get(name), mode).items():
            references[mode][(name, i)] = found
    return checkpoint, adapters, references


def _mixed_batch_logits(
    checkpoint: Path, adapters: dict[str, Path], sequences: dict[tuple[str, int], list[int]],
    mode: str, cpu_kernels: str = "auto",
) -> dict[tuple[str, int], torch.Tensor]:
    """Every sequence in ONE forward (each under its adapter), logits at every row."""
    cpu = torch.device("cpu")
    config = ModelConfig.from_dir(checkpoint)
    weights = load_weights(checkpoint, config, torch.float32, cpu)
    model = DecoderModel(config, weights, cpu, mode,  # type: ignore[arg-type]  # mode: a str from the parametrize list
                         cpu_kernels=cpu_kernels)  # type: ignore[arg-type]  # cpu_kernels: from the parametrize list
    slots = LoraSlots(config, len(adapters), 16, torch.float32, cpu)
    slot_of = {}
    for slot, (name, path) in enumerate(adapters.items()):
        w = adapter_weights(AdapterFetcher(Device("cpu"), None).read_local(name, path), config, 16)
        slots.write(slot, w.adapter_id, w.rank, w.scaling, list(w.blocks))
        slot_of[name] = slot
    kv = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, 4 << 20,
                 torch.float32, cpu)
    backend = TorchLoraBackend(torch.float32, cpu)
    ids: list[int] = []
    positions: list[int] = []
    cache: list[int] = []
    token_slots: list[int] = []
    spans, where = [], {}
    for key, sequence in sequences.items():
        table, start, n = kv.allocator.allocate(len(sequence)), len(ids), len(sequence)
        ids += sequence
        positions += range(n)
        cache += slot_mapping(table, 0, n)
        token_slots += [slot_of.get(key[0], -1)] * n
        spans.append(PrefillSpan(start, n, n, torch.tensor(table)))
        where[key] = (start, n)
    batch = ForwardBatch(
        torch.tensor(ids), torch.tensor(positions), torch.tensor(positions) + 1,
        torch.tensor(cache), 0, torch.zeros(0, 0, dtype=torch.long),
        torch.zeros(0, dtype=torch.long), tuple(spans), torch.arange(len(ids)),
    )
    step = LoraStep.for_step(slots, backend, token_slots, torch.float32, cpu)  # expert deltas too
    logits = model.forward(batch, kv, step)
    return {key: logits[start : start + n] for key, (start, n) in where.items()}


# int8 runs the C++ op where the CPU ops load (these machines), torch's int8pack elsewhere
@pytest.mark.parametrize(("mode", "cpu_kernels"), [(m, "auto") for m in MODES] + [
    ("int8", "torch")], ids=[*MODES, "int8-torch-kernel"])
def test_int8_mixed_batch_agrees_with_peft_over_dequantized_weights(
    family_case: tuple[Path, dict[str, Path], dict[str, Reference]], mode: str, cpu_kernels: str
) -> None:
    checkpoint, adapters, references = family_case
    reference = references[mode]
    ours = _mixed_batch_logits(
        checkpoint, adapters, {key: seq for key, (seq, _) in reference.items()}, mode, cpu_kernels
    )
    found = logit_agreement(((ours[key], expected) for key, (_, expected) in reference.items()),
                            DECISIVE_MARGIN[mode])
    op = mode == "int8" and cpu_kernels == "auto"  # fp32 activations: fp32 rounding only
    assert found.worst <= (OP_INT8_BOUND if op else LOGIT_BOUND[mode]), (
        f"max |Δlogit| / max |logit| = {found.worst:.2e}")
    assert found.p95 <= (OP_INT8_BOUND if op else LOGIT_BOUND_P95[mode]), (
        f"95th percentile {found.p95:.2e}")
    assert found.decisive >= MIN_DECISIVE_SHARE * found.positions, (
        f"{found.decisive}/{found.positions} decisive")
    assert found.decisive_agree >= MIN_DECISIVE_AGREEMENT * found.decisive, (
        f"{found.decisive_agree}/{found.decisive}")
    raw = OP_INT8_RAW_AGREEMENT if op else MIN_RAW_AGREEMENT[mode]
    assert found.agree >= raw * found.positions, f"greedy agreement {found.agree}/{found.positions}"
    n = len(PROMPTS[0])  # the prompt's rows: the same input under every adapter
    for name in adapters:  # the adapters change the logits: the comparison proves something
        assert not torch.allclose(ours[(name, 0)][:n], ours[(BASE, 0)][:n], atol=1e-2)


@pytest.mark.parametrize("family", list(MOE_CONFIGS))
def test_an_int8_moe_base_with_expert_lora_agrees_with_peft_over_dequantized_weights(
    tmp_path: Path, family: str
) -> None:
    """int8 quantizes a MoE model's attention, shared expert and LM head (its router and routed
    experts stay fp32): one mixed batch of the base and an adapter on q_proj and every expert
    (PEFT's fused ``target_parameters``) against PEFT over the dequantized weights, at the C++
    int8 op's bound (fp32 activations: fp32 rounding only)."""
    checkpoint = make_tiny_family(family, tmp_path / "model")
    adapters = {"experts": make_expert_adapter(checkpoint, tmp_path / "experts", rank=4,
                                               targets=["q_proj"], parameters=EXPERT_PARAMETERS,
                                               seed=3)}
    reference = {(name, i): found for name in [BASE, *adapters]
                 for i, found in _reference(checkpoint, adapters.get(name), "int8").items()}
    ours = _mixed_batch_logits(checkpoint, adapters, {k: seq for k, (seq, _) in reference.items()},
                               "int8")
    found = logit_agreement(((ours[key], expected) for key, (_, expected) in reference.items()),
                            DECISIVE_MARGIN["int8"])
    assert found.worst <= OP_INT8_BOUND, f"max |Δlogit| / max |logit| = {found.worst:.2e}"
    assert found.agree >= OP_INT8_RAW_AGREEMENT * found.positions, (
        f"greedy agreement {found.agree}/{found.positions}")
    n = len(PROMPTS[0])
    assert not torch.allclose(ours[("experts", 0)][:n], ours[(BASE, 0)][:n], atol=1e-2)


# -- QLoRA adapters ----------------------------------------------------------------------------
# What PEFT 0.21 writes into adapter_config.json for an adapter trained on a bitsandbytes 4-bit
# base (prepare_model_for_kbit_training + LoraConfig): the same LoraConfig fields as any LoRA;
# only the base's name says 4-bit. LoftQ initialisation (for quantized bases) records itself too.
QLORA_CONFIGS = {
    "qlora": {"base_model_name_or_path": "unsloth/tinyllama-chat-bnb-4bit",
              "init_lora_weights": True, "loftq_config": {}, "inference_mode": True},
    "qlora-loftq": {"base_model_name_or_path": "unsloth/tinyllama-chat-bnb-4bit",
                    "init_lora_weights": "loftq",
                    "loftq_config": {"loftq_bits": 4, "loftq_iter": 1}},
}


@pytest.mark.parametrize("variant", list(QLORA_CONFIGS))
def test_a_qlora_adapter_validates_and_serves_like_any_other_on_an_int8_base(
    variant: str, engine_factory: EngineFactory, tiny_model: Path, tmp_path: Path
) -> None:
    import json
    import shutil

    from lorastream.core.adapter_validation import validate_adapter_dir
    from lorastream.core.generation import PromptInput, SamplingParams
    from lorastream.worker.service.operations import WorkerOperations

    plain = make_family_adapter(tiny_model, tmp_path / "plain", rank=8, targets="all-linear")
    qlora = Path(shutil.copytree(plain, tmp_path / variant))
    config = json.loads((plain / "adapter_config.json").read_text())
    assert not QLORA_CONFIGS[variant].keys() - config.keys()  # PEFT writes these fields itself
    (qlora / "adapter_config.json").write_text(json.dumps({**config, **QLORA_CONFIGS[variant]}))
    validated = validate_adapter_dir(qlora)
    assert validated.base_model == "unsloth/tinyllama-chat-bnb-4bit" and validated.rank == 8

    engine = engine_factory(quantization="int8")
    ops = WorkerOperations(engine)
    ops.load_adapter("plain", str(plain))
    ops.load_adapter(variant, str(qlora))
    tokens = {}
    for name in ("tiny", "plain", variant):
        stream = engine.submit(name, PromptInput(token_ids=(5, 9, 33, 41, 7, 100)),
                               SamplingParams(max_tokens=10))
        tokens[name] = [t for event in stream for t in event.token_ids]
    assert tokens[variant] == tokens["plain"]  # the same tensors: the same output
    assert tokens[variant] != tokens["tiny"]  # and the adapter is applied


FBGEMM = "fbgemm" in torch.backends.quantized.supported_engines


@pytest.mark.parametrize(("device", "capability", "mode", "warned"), [
    ("cpu", "AVX2", "int8", True), ("cpu", "DEFAULT", "int8", True),
    ("cpu", "AVX2", "int8-native", False),  # the C++ op loaded: faster than fp32 there
    ("cpu", "AVX512", "int8", False), ("cpu", "AVX512_BF16", "int8", False),
    ("cuda", "AVX2", "int8", False), ("cpu", "AVX512", "int8-dynamic", False),
    # int8-dynamic runs fbgemm's AVX2 kernels where torch has fbgemm, else _int_mm (slow there)
    ("cpu", "AVX2", "int8-dynamic", not FBGEMM),
    # fp8: CUDA's tensor cores; the CPU's reference loop is slow everywhere
    ("cpu", "AVX512_BF16", "fp8", True), ("cpu", "AVX2", "fp8", True),
])
def test_a_cpu_without_avx512_is_told_which_int8_mode_is_slower_there(
    monkeypatch: pytest.MonkeyPatch, device: str, capability: str, mode: str, warned: bool
) -> None:
    from lorastream.worker.device.quant_matmul import quantization_slow_here

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    native = mode.endswith("-native")
    mode = mode.removesuffix("-native")
    note = quantization_slow_here(torch.device(device), mode, native)
    assert (note is not None) == warned
    if note is not None and mode == "fp8":
        assert "reference loop" in note and "int8-dynamic" in note
    elif note is not None:
        assert capability in note and "slower" in note and mode in note
        assert ("int8-dynamic runs fbgemm" in note) == FBGEMM
        assert ("--cpu-kernels" in note) == (mode == "int8")


@pytest.mark.parametrize(("capability", "refused"), [((8, 6), True), ((8, 9), False),
                                                     ((9, 0), False), ((7, 5), True)])
def test_fp8_is_refused_on_a_gpu_without_e4m3_tensor_cores(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], refused: bool
) -> None:
    from lorastream.worker.device.quant_matmul import quantization_unsupported

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    why = quantization_unsupported(torch.device("cuda"), "fp8")
    assert (why is not None) == refused
    if why is not None:
        assert f"{capability[0]}.{capability[1]}" in why and "8.9 or newer" in why
    for mode in ("int8", "int8-dynamic"):  # torch's int8 kernels run on every GPU
        assert quantization_unsupported(torch.device("cuda"), mode) is None
    assert quantization_unsupported(torch.device("cpu"), "fp8") is None  # the reference loop


def test_an_fp8_worker_on_the_cpu_serves_adapters_and_warns_what_it_costs(
    engine_factory: EngineFactory, tiny_model: Path, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    from lorastream.core.generation import PromptInput, SamplingParams
    from lorastream.worker.service.operations import WorkerOperations

    adapter = make_family_adapter(tiny_model, tmp_path / "a", rank=8, targets="all-linear")
    with caplog.at_level(logging.WARNING, logger="lorastream.worker.service.bootstrap"):
        engine = engine_factory(quantization="fp8")
    assert "--quantization fp8" in caplog.text and "reference loop" in caplog.text
    projections = [p for layer in engine.model.proj for p in layer] + [engine.model.lm_head]
    assert all(isinstance(p, QuantLinear) and p.weight_q.dtype == torch.float8_e4m3fn
               for p in projections)
    WorkerOperations(engine).load_adapter("a", str(adapter))
    tokens = {}
    for name in ("tiny", "a"):
        stream = engine.submit(name, PromptInput(token_ids=(5, 9, 33, 41, 7, 100)),
                               SamplingParams(max_tokens=8, ignore_eos=True))
        tokens[name] = [t for event in stream for t in event.token_ids]
    assert len(tokens["a"]) == len(tokens["tiny"]) == 8
    assert tokens["a"] != tokens["tiny"]  # the adapter is applied over the fp8 base
