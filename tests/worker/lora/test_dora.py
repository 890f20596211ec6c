"""DoRA adapters (``use_dora``) served as transformers + PEFT compute them, batched with plain
LoRAs and the base model (lorastream.worker.lora: the slots' factors, the step's rescale).

Per family (plain Llama; Qwen2's q/k/v biases; Phi-3's fused projections; Gemma 2's soft-caps):
a tiny random checkpoint, a plain LoRA and two DoRA adapters (attention only; all linear with
rsLoRA), B and the magnitudes drawn at random so that DoRA's factor differs from 1 and from
LoRA. Their greedy tokens and logits in ONE mixed batch with the base model must be PEFT's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorastream.worker.device.device import Device
from lorastream.worker.engine.engine import Engine
from lorastream.worker.loading.adapter import adapter_weights
from lorastream.worker.loading.fetch import AdapterFetcher
from lorastream.worker.lora import backend as backend_module
from lorastream.worker.lora.slots import LoraSlots
from lorastream.worker.model.config import SITES
from lorastream.worker.service.bootstrap import build_engine
from lorastream.worker.service.config import WorkerSettings
from tests.support.batched_forward import model_and_slots, prefill_last_logits, preloaded_store
from tests.support.engine_rounds import two_rounds_match
from tests.support.families import (
    BASE,
    NEW_TOKENS,
    PROMPTS,
    FamilyCase,
    dora_adapter_specs,
    make_family_case,
    reference_model,
)
from tests.support.models import FAMILY_CONFIGS

FAMILIES = list(FAMILY_CONFIGS)  # the dense families
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=FAMILIES)
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> FamilyCase:
    family = request.param
    return make_family_case(family, tmp_path_factory.mktemp(family), dora_adapter_specs(family))


@pytest.mark.parametrize("gather_bytes", [4 << 20, 0], ids=["all-layers", "per-layer"])
@pytest.mark.parametrize("chunk", [None, 5], ids=["whole-prompt", "chunked-prefill"])
def test_dora_lora_and_base_in_one_batch_give_peft_logits(
    case: FamilyCase, chunk: int | None, gather_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``gather_bytes``: the step gathers the rows' factors of all layers at once, or layer by
    layer (long prefills, ``DORA_GATHER_BYTES``)."""
    monkeypatch.setattr(backend_module, "DORA_GATHER_BYTES", gather_bytes)
    model, slots, slot_of = model_and_slots(case.checkpoint, case.adapters)
    names, prompt = [BASE, *case.adapters], PROMPTS[1]
    logits = prefill_last_logits(model, slots, slot_of, names, prompt, chunk)
    for row, name in enumerate(names):
        reference = reference_model(case.checkpoint, case.adapters.get(name))
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0, -1]  # [V]
        torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=1e-4, msg=name)


def test_the_slot_factor_is_peft_magnitude_over_its_weight_norm(case: FamilyCase) -> None:
    """``dora_scale`` of every DoRA module is PEFT's ``m / ||W + s B A||`` (its own norm
    function over its own weights), and differs from 1: the norm is really in play."""
    from peft.tuners.lora.layer import LoraLayer

    _, slots, slot_of = model_and_slots(case.checkpoint, case.adapters)
    for name in ("dora-attn-r4", "dora-all-r8-rslora"):
        peft = reference_model(case.checkpoint, case.adapters[name])
        checked = 0
        for path, layer in peft.named_modules():
            if not isinstance(layer, LoraLayer) or "default" not in layer.lora_magnitude_vector:
                continue
            index, module = int(path.split(".layers.")[1].split(".")[0]), path.rsplit(".", 1)[1]
            dora = layer.lora_magnitude_vector["default"]
            with torch.no_grad():
                lora_weight = layer.lora_B["default"].weight @ layer.lora_A["default"].weight
                norm = dora.get_weight_norm(layer.get_base_layer().weight, lora_weight,
                                            layer.scaling["default"])  # [N]
                expected = dora.weight / norm  # [N]
            got = slots.dora_scale[module][index, slot_of[name]]  # [N]
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=path)
            assert not torch.allclose(got, torch.ones_like(got), atol=1e-2), path
            checked += 1
        assert checked > 0, name


@pytest.mark.parametrize("mode", ["int8", "int8-dynamic"])
def test_on_int8_the_norm_is_over_the_dequantized_weights(case: FamilyCase, mode: str) -> None:
    """Quantized bases: ``m / ||dequant(W) + s B A||`` (the weight the mode computes with), which
    is not the factor over the checkpoint's weights."""
    from peft.tuners.lora.layer import LoraLayer

    model, slots, slot_of = model_and_slots(case.checkpoint, case.adapters, quantization=mode)
    name = "dora-all-r8-rslora"
    peft = reference_model(case.checkpoint, case.adapters[name])
    checked = 0
    for path, layer in peft.named_modules():
        if not isinstance(layer, LoraLayer) or "default" not in layer.lora_magnitude_vector:
            continue
        index, module = int(path.split(".layers.")[1].split(".")[0]), path.rsplit(".", 1)[1]
        site = next(s for s, (mods, _) in model.lora_sites.items() if module in mods)
        modules, cols = model.lora_sites[site]
        proj = model.proj[index][SITES.index(site)]
        col, width = cols[modules.index(module)], layer.get_base_layer().weight.shape[0]
        with torch.no_grad():
            held = proj.dequantized()[col : col + width]  # type: ignore[union-attr]  # QuantLinear
            delta = layer.scaling["default"] * (
                layer.lora_B["default"].weight @ layer.lora_A["default"].weight)  # [N, K]
            magnitude = layer.lora_magnitude_vector["default"].weight  # [N]
            expected = magnitude / (held + delta).norm(dim=1)
            unquantized = magnitude / (layer.get_base_layer().weight + delta).norm(dim=1)
        got = slots.dora_scale[module][index, slot_of[name]]  # [N]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=path)
        assert not torch.allclose(got, unquantized, rtol=1e-5, atol=1e-6), path
        checked += 1
    assert checked > 0


def test_a_plain_lora_written_over_a_dora_slot_is_served_as_plain_lora(
    case: FamilyCase
) -> None:
    """The factors of a slot's former DoRA adapter are never read for the plain LoRA after it."""
    model, slots, slot_of = model_and_slots(case.checkpoint, case.adapters)
    config = model.config
    dora, lora = slot_of["dora-all-r8-rslora"], slot_of["lora-r8"]
    w = adapter_weights(AdapterFetcher(Device("cpu"), None).read_local(
        "lora-r8", case.adapters["lora-r8"]), config, 16)
    slots.write(dora, "lora-again", w.rank, w.scaling, list(w.blocks))
    assert not slots.table[dora].dora
    prompt = PROMPTS[0]
    logits = prefill_last_logits(model, slots, {"a": dora, "b": lora}, ["a", "b"], prompt)
    torch.testing.assert_close(logits[0], logits[1])


def test_a_layer_by_layer_write_sets_the_factors_a_whole_write_sets(case: FamilyCase) -> None:
    """The copy plan run layer by layer (an adapter whose layers land one after another: the
    record, then ``layers(l, l + 1)``) leaves a DoRA slot's factors and shifts as the whole
    copy does, over an old DoRA adapter."""
    model, whole, _ = model_and_slots(case.checkpoint, case.adapters)
    config = model.config
    layered = LoraSlots(config, 2, 16, torch.float32, CPU, base=model)

    def weights(name: str) -> tuple[int, float, list[tuple[int, str, str, torch.Tensor]]]:
        w = adapter_weights(AdapterFetcher(Device("cpu"), None).read_local(
            name, case.adapters[name]), config, 16)
        return w.rank, w.scaling, list(w.blocks)

    whole.write(1, "new", *weights("dora-attn-r4"))
    layered.write(1, "old", *weights("dora-all-r8-rslora"))
    plan = layered.copy_plan(1, "new", *weights("dora-attn-r4"))
    plan.record()
    for layer in range(config.num_layers):
        for op in plan.layers(layer, layer + 1):
            op()
    assert layered.table[1].dora and layered.table[1] == whole.table[1]
    for module, scale in layered.dora_scale.items():
        torch.testing.assert_close(scale[:, 1], whole.dora_scale[module][:, 1], msg=module)
        assert torch.equal(scale[:, 2], torch.ones_like(scale[:, 2]))  # the identity entry
    for module, shift in layered.dora_shift.items():
        torch.testing.assert_close(shift[:, 1], whole.dora_shift[module][:, 1], msg=module)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-cache"])
def test_mixed_batch_from_the_store_gives_peft_greedy_tokens(
    case: FamilyCase, tmp_path: Path, prefix_caching: bool
) -> None:
    """Through the store's stream and the worker's tiers into slots, twice (the second round
    reuses cached prefixes where caching is on): every request's tokens are PEFT's."""
    with preloaded_store(case.adapters, tmp_path) as store:
        settings = WorkerSettings(
            model=str(case.checkpoint), served_model_name=BASE, port=0, store=store, max_loras=4,
            max_lora_rank=16, kv_cache_bytes=4 << 20, model_cache_dir=tmp_path / "models",
            prefix_caching=prefix_caching,
        )
        engine: Engine = build_engine(settings, checkpoint=case.checkpoint)
        try:
            cached = two_rounds_match(engine, [BASE, *case.adapters], PROMPTS, NEW_TOKENS,
                                      case.reference, case.family)
            # the second round reused the first's KV blocks (prompt 1 spans a whole block) or not
            assert (cached[("dora-all-r8-rslora", 1)] > 0) is prefix_caching
        finally:
            engine.stop()
    for name in case.adapters:  # each adapter changes the output: the comparison proves something
        assert any(case.reference[(name, i)] != case.reference[(BASE, i)] for i in range(3))
    # DoRA is not LoRA on the same weights: the magnitude and the norm matter
    assert any(case.reference[("dora-all-r8-rslora", i)] != case.reference[("lora-r8", i)]
               for i in range(3))
