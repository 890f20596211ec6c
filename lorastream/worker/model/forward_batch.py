"""What one forward step computes: a flat batch of tokens from many sequences.

Tokens are laid out decode-first: the one new token of each decoding sequence, then the prompt
chunk of each prefilling sequence. Example with two decoding sequences and one prefill of 3::

    row:       0     1     2  3  4
    sequence:  s7    s2    s9 s9 s9
    positions: 40    12    0  1  2

Everything here is built on the host by the scheduler (no device reads in the step loop) and moved
to the device once with non-blocking copies (:meth:`ForwardBatch.to`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch


@dataclass(frozen=True)
class PrefillSpan:
    """One prefilling sequence's chunk in the flat batch."""

    start: int  # first row of the chunk
    length: int  # rows in this step
    context: int  # tokens in the cache after this step (past + length)
    block_table: torch.Tensor  # [blocks] int64


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    seq_lens: torch.Tensor  # [T] int64, its sequence's length after this step (dynamic RoPE)
    slot_mapping: torch.Tensor  # [T] int64, flat KV cache slot of each token
    num_decode: int  # rows 0 .. num_decode-1 are decode tokens
    decode_block_tables: torch.Tensor  # [num_decode, max_blocks] int64 (padded with 0)
    decode_context: torch.Tensor  # [num_decode] int64, cache length incl. the new token
    prefills: tuple[PrefillSpan, ...] = ()
    logit_rows: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    # [n] rows whose next-token logits are needed (the last row of each sequence that samples)
    max_position: int | None = None  # host copies of max(positions), max(seq_lens): the
    longest: int | None = None  # forward never has to read them back from the device

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device) -> ForwardBatch:
        if device.type == "cpu":
            return self

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        return replace(
            self,
            input_ids=move(self.input_ids),
            positions=move(self.positions),
            seq_lens=move(self.seq_lens),
            slot_mapping=move(self.slot_mapping),
            decode_block_tables=move(self.decode_block_tables),
            decode_context=move(self.decode_context),
            prefills=tuple(replace(p, block_table=move(p.block_table)) for p in self.prefills),
            logit_rows=move(self.logit_rows),
        )
