"""Paged KV cache, preallocated once within a byte budget.

Why paged: a per-sequence slot would reserve ``max_seq_len`` tokens for every sequence (94 MB each
for SmolLM2 at 2048 tokens), so a 1 GiB budget would hold 11 sequences. With blocks of
``BLOCK_SIZE`` tokens a sequence holds only what it can use.

Admission reserves, up front, every block a sequence can ever need (prompt + max_tokens), so a
running sequence never runs out of cache and nothing is ever preempted or crashes with an
out-of-memory error: a request that does not fit waits in the queue; one that could never fit is
refused at submission (see :meth:`BlockAllocator.blocks_for`).

Prefix caching (``lorastream/worker/engine/prefix_cache.py``) keeps the full blocks of finished
requests under a hash of their prefix: a block no one holds stays *idle* with its K/V until a new
allocation needs it (least recently released first). A block a sequence holds is never taken.

Layout per layer: ``k[layer]`` and ``v[layer]`` are
``[num_blocks, BLOCK_SIZE, kv_heads, head_dim]``.
Token ``j`` of a sequence lives in block ``table[j // BLOCK_SIZE]`` at row ``j % BLOCK_SIZE``;
its flat slot is ``block * BLOCK_SIZE + j % BLOCK_SIZE``. Example: table [7, 2], token 17 ->
block 2, row 1 -> slot 33.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from lorastream.core.errors import CapacityExhausted

BLOCK_SIZE = 16


class BlockAllocator:
    """Cache blocks (host-side bookkeeping only): who holds each block, and which hold a cached
    prefix.

    A block is in exactly one of three states:

    - held: one or more sequences hold it (``_refs``; the prompt blocks of the n choices of one
      request, or a cached prefix that several requests reuse, have several holders);
    - idle: no one holds it but it carries a prefix hash (:meth:`register`), so a later request
      with the same prefix can take it back (:meth:`lookup`); ``_idle`` keeps these least
      recently released first;
    - free: no holder, no hash.

    A new block comes from the free list, else from the least recently released idle block,
    whose hash is then dropped (the only eviction; a held block is never taken). Example, 4
    blocks: a finished request leaves blocks 0, 1 idle under hashes h0, h1; a request for 3 new
    blocks takes 2, 3 and then evicts 1 (released last by its request, so first in ``_idle``:
    a request frees its blocks tail first, and the tail of a prefix is the least likely to be
    shared); h0 still finds block 0.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._idle: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self._refs: dict[int, int] = {}  # held block -> holders
        self._hash_of: dict[int, bytes] = {}  # block -> its prefix hash
        self._by_hash: dict[bytes, int] = {}  # prefix hash -> block
        self.evictions = 0  # idle blocks whose hash was dropped to make room

    @staticmethod
    def blocks_for(tokens: int) -> int:
        return -(-tokens // BLOCK_SIZE)

    @property
    def free_blocks(self) -> int:
        """Blocks a new allocation can take: free ones and idle cached ones."""
        return len(self._free) + len(self._idle)

    @property
    def used_blocks(self) -> int:
        """Blocks some sequence holds."""
        return self.num_blocks - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        """Blocks carrying a prefix hash, held or idle."""
        return len(self._hash_of)

    def can_allocate(self, tokens: int, reused: list[int] | None = None) -> bool:
        """Would :meth:`allocate` of ``tokens`` succeed, with ``reused`` as its first blocks?"""
        reused = reused or []
        taken_idle = sum(1 for block in reused if block in self._idle)
        return self.blocks_for(tokens) - len(reused) <= self.free_blocks - taken_idle

    def allocate(self, tokens: int, reused: list[int] | None = None) -> list[int]:
        """Blocks for ``tokens``: ``reused`` (cached blocks from :meth:`lookup`, one more hold
        each) followed by new ones."""
        reused = reused or []
        if not self.can_allocate(tokens, reused):
            raise CapacityExhausted(
                f"KV cache has {self.free_blocks} free blocks, "
                f"{self.blocks_for(tokens) - len(reused)} needed"
            )
        for block in reused:
            self._hold(block)
        fresh = [self._take() for _ in range(self.blocks_for(tokens) - len(reused))]
        for block in fresh:
            self._refs[block] = 1
        return reused + fresh

    def _hold(self, block: int) -> None:
        self._idle.pop(block, None)
        self._refs[block] = self._refs.get(block, 0) + 1

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        block, _ = self._idle.popitem(last=False)  # least recently released
        del self._by_hash[self._hash_of.pop(block)]
        self.evictions += 1
        return block

    def share(self, blocks: list[int], holders: int) -> None:
        """``holders`` more sequences hold ``blocks``; each holder frees them once."""
        for block in blocks:
            self._refs[block] = self._refs[block] + holders

    def free(self, blocks: list[int]) -> None:
        """Drop one hold on each block; a block no one holds becomes idle if it carries a
        prefix hash, else free. Released tail first, so that the tail is evicted first."""
        for block in reversed(blocks):
            refs = self._refs[block] - 1
            if refs:
                self._refs[block] = refs
                continue
            del self._refs[block]
            if block in self._hash_of:
                self._idle[block] = None
            else:
                self._free.append(block)

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest run of ``hashes`` from the first (none held here)."""
        blocks = []
        for digest in hashes:
            block = self._by_hash.get(digest)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def register(self, block: int, digest: bytes) -> bool:
        """``block`` (held, every token of it computed) holds the prefix ``digest``. False when
        the hash is already cached in another block (two requests computed the same prefix at
        once: the first stays; this one is freed as an ordinary block)."""
        if digest in self._by_hash or block in self._hash_of:
            return False
        self._by_hash[digest] = block
        self._hash_of[block] = digest
        return True

    def reset(self) -> int:
        """Forget every prefix hash: idle blocks become free; held ones become ordinary blocks
        of their holders. Returns how many hashes were dropped."""
        dropped = len(self._hash_of)
        self._free.extend(reversed(self._idle))
        self._idle.clear()
        self._hash_of.clear()
        self._by_hash.clear()
        return dropped


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
