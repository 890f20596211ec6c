"""Expert LoRAs are sized in bytes like any adapter: the host tier budgets a MoE adapter's whole
manifest, its routed experts included (a ~1 GB adapter of a real MoE shape as much as a tiny
one), and one larger than the whole host budget is refused with its bytes and the flag to
raise, from a local directory and from the store alike. Real PEFT expert LoRAs on tiny MoE
checkpoints, loaded by a real engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lorastream.core import errors
from lorastream.core.manifest import AdapterManifest, TensorInfo
from lorastream.worker.device.device import Device
from lorastream.worker.loading.adapter import AdapterEntry
from lorastream.worker.loading.device_tier import AdmissionCostModel
from lorastream.worker.loading.fetch import AdapterFetcher, HostLoader
from lorastream.worker.loading.host import ALIGN, HostTier
from lorastream.worker.loading.landing import host_nbytes
from lorastream.worker.metrics import WorkerMetrics
from lorastream.worker.model.config import ModelConfig
from lorastream.worker.service.bootstrap import build_engine
from lorastream.worker.service.config import WorkerSettings
from lorastream.worker.service.operations import WorkerOperations
from tests.support.families import BASE
from tests.support.models import (
    EXPERT_PARAMETERS,
    MOE_CONFIGS,
    make_expert_adapter,
    make_family_adapter,
    make_tiny_family,
)

# Real MoE shapes (config.json values) and a rank at which an expert LoRA on them is ~1 GB.
COMMON = dict(vocab_size=151936, rms_norm_eps=1e-6, max_position_embeddings=32768,
              tie_word_embeddings=False, rope_theta=1e6)
REAL_SHAPES = {
    "qwen3-30b-a3b-r6": (dict(family="qwen3_moe", hidden_size=2048, num_layers=48,
                              num_heads=32, num_kv_heads=4, head_dim=128, num_experts=128,
                              experts_per_token=8, intermediate_size=6144,
                              moe_intermediate_size=768), 6),
    "mixtral-8x7b-r16": (dict(family="mixtral", hidden_size=4096, num_layers=32, num_heads=32,
                             num_kv_heads=8, head_dim=128, num_experts=8, experts_per_token=2,
                             intermediate_size=14336, moe_intermediate_size=14336), 16),
}


def expert_lora_manifest(config: ModelConfig, rank: int) -> AdapterManifest:
    """The manifest of a PEFT expert LoRA (fused form, attention too) of ``config``'s shape:
    every tensor's name, shape and bytes, no data."""
    h, i, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
    q, kv = config.q_size, config.kv_size
    shapes: dict[str, tuple[int, int]] = {}
    for layer in range(config.num_layers):
        base = f"base_model.model.model.layers.{layer}"
        for module, (fan_in, fan_out) in {"q_proj": (h, q), "k_proj": (h, kv),
                                          "v_proj": (h, kv), "o_proj": (q, h)}.items():
            shapes[f"{base}.self_attn.{module}.lora_A.weight"] = (rank, fan_in)
            shapes[f"{base}.self_attn.{module}.lora_B.weight"] = (fan_out, rank)
        shapes[f"{base}.mlp.experts.base_layer.lora_A.weight"] = (e * rank, h)
        shapes[f"{base}.mlp.experts.base_layer.lora_B.weight"] = (2 * i, e * rank)
        shapes[f"{base}.mlp.experts.lora_A.weight"] = (e * rank, i)
        shapes[f"{base}.mlp.experts.lora_B.weight"] = (h, e * rank)
    tensors = tuple(TensorInfo(name, "F32", shape, 4 * shape[0] * shape[1], "")
                    for name, shape in shapes.items())
    return AdapterManifest(
        adapter_id="0" * 64, name="big", source_uri="", revision="", base_model="", rank=rank,
        alpha=2.0 * rank, use_rslora=False,
        target_modules=("experts", "k_proj", "o_proj", "q_proj", "v_proj"), tensors=tensors)


@pytest.fixture
def device() -> Iterator[Device]:
    d = Device("cpu")
    yield d
    d.close()


@pytest.mark.parametrize("shape", list(REAL_SHAPES))
def test_the_host_tier_budgets_a_1gb_expert_lora_whole(shape: str, device: Device) -> None:
    fields, rank = REAL_SHAPES[shape]
    config = ModelConfig(**COMMON, **fields)  # type: ignore[arg-type]  # fields: ModelConfig's own keywords
    manifest = expert_lora_manifest(config, rank)
    expert_bytes = sum(t.nbytes for t in manifest.tensors if ".experts." in t.name)
    assert 0.8e9 < manifest.total_bytes < 1.3e9 and expert_bytes > 0.9 * manifest.total_bytes
    need = host_nbytes(manifest)
    assert manifest.total_bytes <= need < manifest.total_bytes + ALIGN * len(manifest.tensors)

    def begin(budget: int) -> AdapterEntry:
        host = HostTier(device, budget, WorkerMetrics())  # untouched pages cost no memory
        loader = HostLoader(host, None, config, rank, WorkerMetrics(),  # type: ignore[arg-type]  # begin never fetches
                            AdmissionCostModel())
        entry = AdapterEntry("0" * 64, "big", manifest)
        started = loader.begin([entry], entry)
        assert started == (entry.error is None)
        return entry

    short = begin(need - ALIGN)  # one page short: the experts are counted, not just attention
    assert isinstance(short.error, errors.CapacityExhausted)
    assert f"needs {need} bytes of host memory, more than the whole host budget" in str(
        short.error) and "--host-cache-bytes" in str(short.error)
    fits = begin(need)
    assert fits.error is None and fits.host_bytes == need


@pytest.fixture(scope="module", params=list(MOE_CONFIGS))
def moe(request: pytest.FixtureRequest,
        tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A tiny MoE checkpoint, an attention-only LoRA and an expert LoRA (rank 4) of it."""
    root = tmp_path_factory.mktemp(request.param)
    checkpoint = make_tiny_family(request.param, root / "model")
    attention = make_family_adapter(checkpoint, root / "attention", rank=4,
                                    targets=["q_proj", "v_proj"], seed=1)
    experts = make_expert_adapter(checkpoint, root / "experts", rank=4, targets=["q_proj"],
                                  parameters=EXPERT_PARAMETERS, seed=2)
    return checkpoint, attention, experts


def _host_bytes(path: Path, device: Device) -> tuple[int, int]:
    """(host bytes the tier budgets for the adapter at ``path``, its expert tensors' bytes)."""
    manifest = AdapterFetcher(device, None).read_local("probe", path).manifest
    assert manifest is not None
    return host_nbytes(manifest), sum(t.nbytes for t in manifest.tensors if ".experts" in t.name)


def test_an_expert_lora_over_the_host_budget_is_refused_and_one_within_is_counted_whole(
        moe: tuple[Path, Path, Path], tmp_path: Path, device: Device) -> None:
    checkpoint, attention, experts = moe
    need, expert_tensors = _host_bytes(experts, device)
    assert expert_tensors > 0 and _host_bytes(attention, device)[0] < need - ALIGN

    def engine(budget: int) -> WorkerOperations:
        return WorkerOperations(build_engine(WorkerSettings(
            model=str(checkpoint), served_model_name=BASE, max_loras=2, max_lora_rank=8,
            kv_cache_bytes=1 << 20, host_cache_bytes=budget, model_cache_dir=tmp_path / "m",
        ), checkpoint=checkpoint))

    short = engine(need - ALIGN)  # room for the attention adapter, one page short of the other
    try:
        short.load_adapter("attention", str(attention))
        with pytest.raises(errors.CapacityExhausted, match=rf"needs {need} bytes of host memory, "
                           r"more than the whole host budget .*raise --host-cache-bytes"):
            short.load_adapter("experts", str(experts))
    finally:
        short.engine.stop()
    fits = engine(need)
    try:
        fits.load_adapter("experts", str(experts))
        assert fits.engine.adapters.usage().host_bytes_used == need
    finally:
        fits.engine.stop()
