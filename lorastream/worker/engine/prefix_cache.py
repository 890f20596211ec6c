"""Automatic prefix caching: a request whose prompt starts with full blocks already computed for
the same model, adapter version and quantization takes those blocks instead of prefilling them.

A full block of ``BLOCK_SIZE`` tokens is named by a chain hash::

    key    = H(base model identity, quantization mode, adapter content id or "base")
    h[0]   = H(key, tokens[0:16])
    h[i]   = H(h[i-1], key, tokens[16 i : 16 (i+1)])

so a block's hash names its whole prefix. Its K/V depend on nothing else: every earlier token
(the chain), the base weights (identity and quantization) and the adapter's weights (its content
id, not its name: a new version pushed under the same name has another id and never matches; an
evicted adapter's blocks can only ever be found by the same content again). Example: two
requests to adapter ``a1b2`` whose prompts share their first 40 tokens share blocks 0 and 1
(tokens 0-31); the third block differs in its hash from token 40 on, so it is computed.

Rules (the allocator, ``kv_cache.BlockAllocator``, keeps the blocks):

- at admission, a request takes the longest run of cached blocks of its prompt, at most
  ``(len(prompt) - 1) // BLOCK_SIZE`` of them: the last prompt token is always computed, so the
  first sampled token has its logits; prefill starts after them (chunked prefill as usual);
- a block is registered once every token of it is computed (prompt or generated), by the
  sequence that holds it; a request that finishes leaves its registered blocks idle, evicted
  least recently used only when a new block is needed;
- sequences admitted layer by layer while their adapter lands (``layered_prefill.py``) reuse nothing
  (they write their whole prompt layer by layer) but register what they computed;
- the sliding-window layers (Mistral, Gemma) need nothing special: a block's K/V are the same
  whatever the window, and attention over a cached past masks the same keys as over a computed
  one (``attention._prefill``);
- an activated LoRA (``activation.py``) computes the blocks before its invocation with the base
  model: they take the base key, so a base-model request and every activated adapter on the
  same prompt share them. Its later blocks take its adapter key, with the position its delta
  starts from mixed in (two activation points inside one block give that block other K/V)::

      lora_from = 40:  blocks 0, 1 (tokens 0-31)  key "base"
                       blocks 2, ... (tokens 32-)  key H(base, adapter id, 40)

- a weighted mix (``core/adapter_mix.py``) takes the key of its components' content ids AND
  weights (each weight's exact float), so two weightings of the same adapters never share
  K/V, and a mix never shares them with its components alone;
- RoPE that depends on the sequence's length ('dynamic', 'longrope') computes the same K only
  while the sequence stays within the original context: a request that could grow past it
  neither reuses nor registers blocks.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from dataclasses import dataclass

from lorastream.worker.engine.sequence import Sequence
from lorastream.worker.model.config import ModelConfig
from lorastream.worker.model.kv_cache import BLOCK_SIZE, BlockAllocator

log = logging.getLogger(__name__)

_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return h.digest()


def rope_length_limit(config: ModelConfig) -> int | None:
    """The longest sequence whose K/V do not depend on its length (None: any length)."""
    limits = []
    for scaling in (config.rope_scaling, config.local_rope_scaling):
        if not scaling:
            continue
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind in _LENGTH_DEPENDENT_ROPE:
            original = scaling.get("original_max_position_embeddings")
            limits.append(int(original or config.max_position_embeddings))
    return min(limits) if limits else None


@dataclass
class PrefixCacheStats:
    """Counters since the start (a reset of the cache keeps them)."""

    queried_tokens: int = 0  # prompt tokens of admitted requests that looked
    hit_tokens: int = 0  # of those, tokens taken from the cache
    resets: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class PrefixCache:
    """Hashes of sequences' full blocks, the lookup at admission and the registration of
    computed blocks. Used by the scheduler on the engine thread only."""

    def __init__(
        self,
        allocator: BlockAllocator,
        config: ModelConfig,
        *,
        enabled: bool = True,
        base_identity: str = "",
        quantization: str = "none",
    ) -> None:
        self.allocator = allocator
        self.enabled = enabled
        self.length_limit = rope_length_limit(config)
        # every hyper-parameter (and the served name) of the base: its identity in this process
        self._base = _digest(base_identity.encode(), repr(config).encode(), quantization.encode())
        self._base_key = _digest(self._base, b"base")
        self.stats = PrefixCacheStats()

    def _cacheable(self, seq: Sequence) -> bool:
        return self.enabled and (self.length_limit is None or seq.max_len <= self.length_limit)

    def _key(self, seq: Sequence, block: int) -> bytes:
        """The key of ``seq``'s ``block``: the base model's when no row of it takes a delta."""
        if seq.mix:
            parts = ",".join(f"{adapter_id}={weight.hex()}" for adapter_id, weight in seq.mix)
            return _digest(self._base, b"mix:" + parts.encode())
        if seq.adapter_id is None or (block + 1) * BLOCK_SIZE <= seq.lora_from:
            return self._base_key
        adapter = b"adapter:" + seq.adapter_id.encode()
        if seq.lora_from > 0:  # an activated LoRA: where its delta starts
            adapter += b"@" + str(seq.lora_from).encode()
        return _digest(self._base, adapter)

    def block_hashes(self, seq: Sequence, count: int) -> list[bytes]:
        """Hashes of ``seq``'s first ``count`` full blocks (kept on it, extended as needed)."""
        hashes = seq.block_hashes
        if len(hashes) < count:
            tokens = seq.prompt_ids
            if count * BLOCK_SIZE > len(tokens):  # generated tokens fill the later blocks
                tokens = tokens + seq.output_ids
            while len(hashes) < count:
                i = len(hashes)
                chunk = array("q", tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]).tobytes()
                key = self._key(seq, i)
                hashes.append(_digest(hashes[-1] if hashes else b"", key, chunk))
        return hashes[:count]

    def match(self, seq: Sequence) -> list[int]:
        """The cached blocks ``seq`` can start from (its prompt's last token left to compute)."""
        if not self._cacheable(seq):
            return []
        usable = (len(seq.prompt_ids) - 1) // BLOCK_SIZE
        return self.allocator.lookup(self.block_hashes(seq, usable)) if usable else []

    def admitted(self, seq: Sequence, reused: int) -> None:
        """``seq`` was admitted starting from ``reused`` cached blocks."""
        seq.num_computed = seq.cached_tokens = reused * BLOCK_SIZE
        seq.registered_blocks = reused
        if self._cacheable(seq):
            self.stats.queried_tokens += len(seq.prompt_ids)
            self.stats.hit_tokens += seq.cached_tokens

    def commit(self, seq: Sequence) -> None:
        """Register the blocks of ``seq`` whose every token is now computed."""
        full = min(seq.num_computed // BLOCK_SIZE, self._own_blocks(seq))
        if full <= seq.registered_blocks or not self._cacheable(seq):
            return
        hashes = self.block_hashes(seq, full)
        for i in range(seq.registered_blocks, full):
            self.allocator.register(seq.blocks[i], hashes[i])
        seq.registered_blocks = full

    @staticmethod
    def _own_blocks(seq: Sequence) -> int:
        """Blocks of ``seq``'s own table (choice 0 of n > 1 holds its siblings' too until the
        fork)."""
        return BlockAllocator.blocks_for(seq.max_len)

    def forked(self, parent: Sequence, children: list[Sequence]) -> None:
        """Choices forked from ``parent`` share its full prompt blocks, registered or not."""
        shared = len(parent.prompt_ids) // BLOCK_SIZE
        for child in children:
            child.block_hashes = list(parent.block_hashes[:shared])
            child.registered_blocks = min(parent.registered_blocks, shared)
            child.cached_tokens = parent.cached_tokens

    def reset(self) -> int:
        """Forget every cached prefix (operator API); returns how many blocks were dropped."""
        dropped = self.allocator.reset()
        self.stats.resets += 1
        log.info("prefix cache reset: %d cached blocks dropped", dropped)
        return dropped
