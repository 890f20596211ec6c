"""docs/design.md rule 3: nothing on the step path reads a device tensor back to the host.

On CUDA such a read (``.item()``, ``.tolist()``, ``.cpu()``, ``bool(t)``, ``int(t)``) forces a
host-device sync and stalls the step. These machines have no GPU, so the test forbids every such
read while the LoRA metadata is prepared and the forward runs: any call raises."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorastream.worker.engine.step_inputs import StepPlan, build_step_inputs
from lorastream.worker.lora.backend import LoraStep, TorchLoraBackend
from lorastream.worker.lora.slots import LoraSlots, SlotInfo
from lorastream.worker.model.config import ModelConfig
from lorastream.worker.model.decoder import DecoderModel
from lorastream.worker.model.kv_cache import KVCache
from lorastream.worker.model.weights import load_weights
from tests.support.models import make_tiny_checkpoint
from tests.support.step_sequences import StepSeq
from tests.support.sync_free import no_device_reads


@pytest.mark.parametrize("with_mix", [False, True], ids=["plain", "with-a-mix-row"])
@pytest.mark.parametrize(
    "rope_scaling",
    [None, {"rope_type": "dynamic", "factor": 2.0},
     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64}],
    ids=["default", "dynamic", "llama3"],
)
def test_a_mixed_lora_step_reads_nothing_back_from_the_device(
    tmp_path: Path, rope_scaling: dict[str, object] | None, with_mix: bool
) -> None:
    checkpoint = make_tiny_checkpoint(tmp_path / "m", rope_scaling=rope_scaling,
                                      max_position_embeddings=128)
    config = ModelConfig.from_dir(checkpoint)
    cpu = torch.device("cpu")
    model = DecoderModel(config, load_weights(checkpoint, config, torch.float32, cpu), cpu)
    model.rope.cos_sin(torch.arange(200))  # grow the tables beyond the step (as a long run would)
    kv = KVCache(
        config.num_layers, config.num_kv_heads, config.head_dim, 1 << 20, torch.float32, cpu
    )
    slots = LoraSlots(config, 2, 8, torch.float32, cpu)
    for s in range(2):
        for m in slots.a:
            slots.a[m][:, s, :4].normal_(0, 0.1)
            slots.b[m][:, s, :, :4].normal_(0, 0.1)
        slots.table[s] = SlotInfo(f"id{s}", 4, 2.0, frozenset(slots.a))
    decode = [StepSeq([5, 6, 7, 8], 4, kv.allocator.allocate(8), 0),
              StepSeq([9] * 20, 20, kv.allocator.allocate(24), -1)]
    if with_mix:  # a weighted mix of both slots (the entry layout and its index_add_)
        decode.append(StepSeq([4, 4, 4], 3, kv.allocator.allocate(8), -1, ((0, 0.7), (1, 0.3))))
    prefill = [(StepSeq([3, 4, 5, 6, 7], 0, kv.allocator.allocate(8), 1), 5)]
    plan = StepPlan(decode=decode, prefill=prefill)  # type: ignore[arg-type]  # StepSeq: the fields of a Sequence that steps read
    backend = TorchLoraBackend(torch.float32, cpu)
    inputs = build_step_inputs(plan)  # host lists -> host tensors (no device involved)
    with no_device_reads():
        lora = LoraStep.for_step(slots, backend, inputs.token_slots, torch.float32, cpu,
                                 logit_rows=inputs.logit_rows)
        assert lora is not None
        logits = model.forward(inputs.batch.to(cpu), kv, lora)
    assert logits.shape == (3 + with_mix, config.vocab_size)


def test_the_guard_catches_a_read_back() -> None:
    from lorastream.worker.model.rope import RotaryEmbedding

    rope = RotaryEmbedding(16, 10000.0, 64, None)
    with no_device_reads(), pytest.raises(AssertionError, match="forces a device sync"):
        rope.cos_sin(torch.arange(5))  # without max_position it must look at the positions
