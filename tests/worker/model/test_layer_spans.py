"""A forward run in spans of layers, the hidden states carried between them, is the one-pass
forward exactly: logits and every key and value written (what a prefill that starts while its
adapter's later layers still land relies on, docs/design.md "Layer-ordered admission").

Per family (sliding windows, soft-capping, q/k norms, Gemma's extra norms), a mixed batch of
the base model and an adapter, a decode row over a cached past and a prefill chunk.
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
from lorastream.worker.model.config import ModelConfig
from lorastream.worker.model.decoder import DecoderModel
from lorastream.worker.model.forward_batch import ForwardBatch, PrefillSpan
from lorastream.worker.model.kv_cache import KVCache, slot_mapping
from lorastream.worker.model.weights import load_weights
from tests.support.models import (
    FAMILY_CONFIGS,
    FAMILY_TARGETS,
    make_family_adapter,
    make_tiny_family,
)

CPU = torch.device("cpu")
PROMPT = [5, 9, 14, 3, 27, 8, 11, 2, 19, 6, 30]  # longer than the tiny families' window


def _prefill(ids: list[int], past: int, table: list[int], start: int) -> dict[str, object]:
    return {"ids": ids, "positions": list(range(past, past + len(ids))),
            "span": PrefillSpan(start, len(ids), past + len(ids), torch.tensor(table))}


def _batch(kv: KVCache, tables: dict[str, list[int]], decode: str, chunk: str,
           past: int) -> ForwardBatch:
    """Row 0 decodes ``decode``'s token at position ``past`` (its past cached); then ``chunk``
    prefills PROMPT[past:] over its cached past."""
    ids = [PROMPT[past]]
    positions = [past]
    cache = slot_mapping(tables[decode], past, 1)
    rest = PROMPT[past:]
    ids += rest
    positions += list(range(past, len(PROMPT)))
    cache += slot_mapping(tables[chunk], past, len(rest))
    nb = len(tables[decode])
    return ForwardBatch(
        torch.tensor(ids), torch.tensor(positions), torch.tensor(positions) + 1,
        torch.tensor(cache), 1, torch.tensor([tables[decode][:nb]]),
        torch.tensor([past + 1]),
        (PrefillSpan(1, len(rest), len(PROMPT), torch.tensor(tables[chunk])),),
        torch.tensor([0, len(ids) - 1]),
    )


def _prime(model: DecoderModel, kv: KVCache, table: list[int], past: int) -> None:
    """Prefill PROMPT[:past] of one sequence (base model) into ``table``'s blocks."""
    ids = PROMPT[:past]
    batch = ForwardBatch(
        torch.tensor(ids), torch.arange(past), torch.arange(past) + 1,
        torch.tensor(slot_mapping(table, 0, past)), 0, torch.zeros(0, 0, dtype=torch.long),
        torch.zeros(0, dtype=torch.long), (PrefillSpan(0, past, past, torch.tensor(table)),),
        torch.tensor([past - 1]),
    )
    model.forward(batch, kv)


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_layer_spans_give_the_one_pass_forward(family: str, tmp_path: Path) -> None:
    deeper: dict[str, object] = {"num_hidden_layers": 4}
    if "layer_types" in FAMILY_CONFIGS[family]:  # Gemma 3: sliding, full, sliding, full
        deeper["layer_types"] = list(FAMILY_CONFIGS[family]["layer_types"]) * 2  # type: ignore[call-overload]  # the config dict's values are object
    checkpoint = make_tiny_family(family, tmp_path / "m", **deeper)
    attn, mlp = FAMILY_TARGETS[family]
    adapter = make_family_adapter(checkpoint, tmp_path / "a", rank=4, targets=attn + mlp)
    config = ModelConfig.from_dir(checkpoint)
    model = DecoderModel(config, load_weights(checkpoint, config, torch.float32, CPU), CPU)
    slots = LoraSlots(config, 1, 8, torch.float32, CPU)
    w = adapter_weights(AdapterFetcher(Device("cpu"), None).read_local("a", adapter), config, 8)
    slots.write(0, w.adapter_id, w.rank, w.scaling, list(w.blocks))
    backend = TorchLoraBackend(torch.float32, CPU)
    layers = config.num_layers
    assert layers == 4
    past = 7

    def run(spans: list[tuple[int, int]] | None) -> tuple[torch.Tensor, KVCache]:
        """The batch's logits and cache: by ``forward`` (None) or over ``spans`` of layers."""
        kv = KVCache(layers, config.num_kv_heads, config.head_dim, 1 << 20, torch.float32, CPU)
        tables = {n: kv.allocator.allocate(len(PROMPT) + 1) for n in ("dec", "pre")}
        for name in tables:
            _prime(model, kv, tables[name], past)
        batch = _batch(kv, tables, "dec", "pre", past)
        rows = 1 + len(PROMPT) - past
        lora = LoraStep(slots, backend, backend.prepare([0] + [-1] * (rows - 1), slots))
        if spans is None:
            return model.forward(batch, kv, lora), kv
        x = model.embed(batch)
        for start, stop in spans:
            x = model.run_layers(x, batch, kv, lora, start, stop)
        return model.head(x, batch), kv

    whole, kv_whole = run(None)
    for spans in ([(0, layers)], [(0, 1), (1, 3), (3, 4)], [(i, i + 1) for i in range(layers)],
                  [(0, 0), (0, 2), (2, 2), (2, 4)]):
        logits, kv = run(spans)
        assert torch.equal(logits, whole), spans
        for i in range(layers):
            assert torch.equal(kv.k[i], kv_whole.k[i]) and torch.equal(kv.v[i], kv_whole.v[i])
    assert torch.isfinite(whole).all() and whole.shape == (2, config.vocab_size)
