"""Paged KV cache, preallocated once within a byte budget.

Why paged: a per-sequence slot would reserve ``max_seq_len`` tokens for every sequence (94 MB each
for SmolLM2 at 2048 tokens), so a 1 GiB budget would hold 11 sequences. With blocks of
``BLOCK_SIZE`` tokens a sequence holds only what it can use.

Admission reserves, up front, every block a sequence can ever need (prompt + max_tokens), so a
running sequence never runs out of cache and nothing is ever preempted or crashes with an
out-of-memory error: a request that does not fit waits in the queue; one that could never fit is
refused at submission (see :meth:`BlockAllocator.blocks_for`).

Layout per layer: ``k[layer]`` and ``v[layer]`` are ``[num_blocks, BLOCK_SIZE, kv_heads, head_dim]``.
Token ``j`` of a sequence lives in block ``table[j // BLOCK_SIZE]`` at row ``j % BLOCK_SIZE``;
its flat slot is ``block * BLOCK_SIZE + j % BLOCK_SIZE``. Example: table [7, 2], token 17 ->
block 2, row 1 -> slot 33.
"""

from __future__ import annotations

import torch

from lorastream.core.errors import CapacityExhausted

BLOCK_SIZE = 16


class BlockAllocator:
    """Free list of cache blocks (host-side bookkeeping only), with reference counts for blocks
    that several sequences hold (the prompt blocks of the n choices of one request)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._refs: dict[int, int] = {}  # block -> holders, for blocks held more than once

    @staticmethod
    def blocks_for(tokens: int) -> int:
        return -(-tokens // BLOCK_SIZE)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, tokens: int) -> bool:
        return self.blocks_for(tokens) <= len(self._free)

    def allocate(self, tokens: int) -> list[int]:
        need = self.blocks_for(tokens)
        if need > len(self._free):
            raise CapacityExhausted(f"KV cache has {len(self._free)} free blocks, {need} needed")
        return [self._free.pop() for _ in range(need)]

    def share(self, blocks: list[int], holders: int) -> None:
        """``holders`` more sequences hold ``blocks``; each holder frees them once."""
        for block in blocks:
            self._refs[block] = self._refs.get(block, 1) + holders

    def free(self, blocks: list[int]) -> None:
        """Drop one hold on each block; a block is free again when its last holder let go."""
        released = []
        for block in blocks:
            refs = self._refs.pop(block, 1)
            if refs > 2:
                self._refs[block] = refs - 1
            elif refs == 2:
                pass  # one holder is left: an ordinary, singly held block again
            else:
                released.append(block)
        self._free.extend(reversed(released))


class KVCache:
    """The cache tensors of every layer plus their allocator."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        budget_bytes: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_block = 2 * num_layers * BLOCK_SIZE * num_kv_heads * head_dim * itemsize
        num_blocks = budget_bytes // per_block
        if num_blocks < 1:
            raise CapacityExhausted(
                f"kv cache budget {budget_bytes} bytes holds no block of {per_block} bytes; "
                "raise --kv-cache-bytes"
            )
        shape = (num_layers, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, blocks, bs, kvh, d]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.allocator = BlockAllocator(num_blocks)
        self.bytes_per_block = per_block

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * BLOCK_SIZE

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def slot_mapping(block_table: list[int], start: int, count: int) -> list[int]:
    """Flat cache slots of tokens ``start .. start+count-1`` of a sequence."""
    return [
        block_table[j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE
        for j in range(start, start + count)
    ]
