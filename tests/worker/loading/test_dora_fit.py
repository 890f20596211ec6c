"""A DoRA adapter's magnitude vectors are checked against the base before a slot sees them
(lorastream.worker.loading's ``check_fits``; the gateway's ``misfit`` says the same)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from lorastream.core.adapter_fit import BaseShape, misfit
from lorastream.core.adapter_validation import validate_adapter_dir
from lorastream.core.errors import InvalidAdapter
from lorastream.core.manifest import AdapterManifest
from lorastream.worker.loading.adapter import check_fits
from lorastream.worker.model.config import ModelConfig
from tests.support.models import ATTENTION, make_peft_adapter

Q_M = "base_model.model.model.layers.1.self_attn.q_proj.lora_magnitude_vector"


@pytest.fixture(scope="module")
def dora_manifest(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> AdapterManifest:
    adapter = make_peft_adapter(tiny_model, tmp_path_factory.mktemp("dora") / "a", rank=4,
                                targets=ATTENTION, use_dora=True)
    return validate_adapter_dir(adapter).manifest(adapter_id="x", name="d", source_uri="")


def _base(config: ModelConfig) -> BaseShape:
    return BaseShape(config.num_layers, config.module_shapes())


def test_a_dora_adapter_of_the_base_fits(tiny_model: Path, dora_manifest: AdapterManifest
                                         ) -> None:
    config = ModelConfig.from_dir(tiny_model)
    check_fits(dora_manifest, config, 16)
    assert misfit(dora_manifest, _base(config)) is None


def test_a_magnitude_of_another_width_is_refused_naming_it(
    tiny_model: Path, dora_manifest: AdapterManifest
) -> None:
    config = ModelConfig.from_dir(tiny_model)
    tensors = tuple(replace(t, shape=(63,)) if t.name == Q_M else t
                    for t in dora_manifest.tensors)
    wrong = dora_manifest.replace(tensors=tensors)
    why = r"layer 1 q_proj lora_magnitude_vector is \[63\], but .* needs \[64\]"
    with pytest.raises(InvalidAdapter, match=why):
        check_fits(wrong, config, 16)
    reason = misfit(wrong, _base(config))
    assert reason is not None and "lora_magnitude_vector is [63]" in reason


def test_a_dora_adapter_missing_one_magnitude_is_refused(
    tiny_model: Path, dora_manifest: AdapterManifest
) -> None:
    config = ModelConfig.from_dir(tiny_model)
    partial = dora_manifest.replace(
        tensors=tuple(t for t in dora_manifest.tensors if t.name != Q_M))
    with pytest.raises(InvalidAdapter, match="layer 1 q_proj has no lora_magnitude_vector"):
        check_fits(partial, config, 16)
