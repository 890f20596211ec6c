"""A stand-in for the engine's Sequence with only the fields a step's inputs read
(``engine/step_inputs.py``), for tests that build steps without the engine."""

from __future__ import annotations

from lorastream.worker.lora.backend import RowLora


class StepSeq:
    """The fields of a Sequence that step inputs read."""

    def __init__(self, prompt: list[int], computed: int, blocks: list[int], slot: int,
                 mix: tuple[tuple[int, float], ...] = ()) -> None:
        self.prompt_ids, self.output_ids = prompt, [7]
        self.num_computed, self.blocks, self.slot, self.mix = computed, blocks, slot, mix

    def token_at(self, index: int) -> int:
        return (self.prompt_ids + self.output_ids)[index]

    def lora_slot(self, position: int) -> int:
        """The slot position ``position`` reads (a plain LoRA: every position its slot)."""
        return self.slot

    def lora_row(self, position: int) -> RowLora:
        """What position ``position`` takes: its slot, or its mix's (slot, weight) pairs."""
        return self.mix or self.slot

    @property
    def remaining_prompt(self) -> int:
        return len(self.prompt_ids) - self.num_computed
