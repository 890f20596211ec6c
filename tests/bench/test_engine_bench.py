"""The engine benchmark's read probe: it reads exactly the bytes a multi-adapter decode step
reads, which is what the page's bandwidth ceiling is computed from."""

from __future__ import annotations

import pytest
import torch

from lorastream.bench.engine import read_ms, step_read_views
from lorastream.bench.synthetic import ALL_LINEAR, BaseShape, adapter_nbytes
from lorastream.worker.lora.slots import LoraSlots
from lorastream.worker.model.config import LlamaConfig

SHAPE = BaseShape(hidden=64, intermediate=160, num_layers=3, num_heads=4, num_kv_heads=2,
                  head_dim=16)


def _config() -> LlamaConfig:
    s = SHAPE
    return LlamaConfig(
        vocab_size=32, hidden_size=s.hidden, intermediate_size=s.intermediate,
        num_layers=s.num_layers, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads,
        head_dim=s.head_dim, rms_norm_eps=1e-5, max_position_embeddings=64,
        tie_word_embeddings=True, rope_theta=1e4,
    )


@pytest.mark.parametrize("distinct", [1, 3, 5])
def test_the_probe_reads_each_distinct_adapters_weights_once(distinct: int) -> None:
    slots = LoraSlots(_config(), 5, 16, torch.float32, torch.device("cpu"))
    views = step_read_views(slots, distinct)
    read = sum(v.numel() * v.element_size() for v in views)
    assert read == distinct * adapter_nbytes(SHAPE, 16, ALL_LINEAR)
    # no byte twice: the views are disjoint
    spans = sorted((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()) for v in views)
    assert all(end <= begin for (_, end), (begin, _) in zip(spans, spans[1:]))
    assert all(v.is_contiguous() for v in views)  # streamed, not gathered


def test_read_times_are_sampled_in_milliseconds() -> None:
    views = [torch.ones(1 << 20)]  # 4 MB
    times = read_ms(views, samples=3, pause_s=0.0)
    assert len(times) == 3 and all(0 < t < 5_000 for t in times)
