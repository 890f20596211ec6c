"""The prefix cache's bookkeeping: block states, LRU eviction of idle blocks only, the chain
hash and what goes into its key (no engine; tests/worker/engine/test_prefix_cache_engine.py runs
it)."""

from __future__ import annotations

import random

import pytest

from lorastream.core.errors import CapacityExhausted
from lorastream.worker.engine.prefix_cache import PrefixCache, rope_length_limit
from lorastream.worker.engine.sampling import SamplingParams
from lorastream.worker.engine.sequence import RequestStream, Sequence
from lorastream.worker.model.config import ModelConfig
from lorastream.worker.model.kv_cache import BLOCK_SIZE, BlockAllocator

CONFIG = ModelConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=512,
    tie_word_embeddings=True, rope_theta=10000.0, name="tiny",
)


def seq(prompt: list[int], adapter: str | None = None, max_tokens: int = 8) -> Sequence:
    return Sequence(
        request_id="r", prompt_ids=list(prompt), params=SamplingParams(), adapter_id=adapter,
        stream=RequestStream("r"), detokenizer=None,  # type: ignore[arg-type]  # a sequence without a detokenizer suffices
        generator=None, max_len=len(prompt) + max_tokens, eos_ids=frozenset(),
    )


def admit(cache: PrefixCache, s: Sequence) -> list[int]:
    """What the scheduler does: take the cached prefix, allocate the rest."""
    reused = cache.match(s)
    s.blocks = cache.allocator.allocate(s.max_len, reused)
    cache.admitted(s, len(reused))
    return reused


def run_to_end(cache: PrefixCache, s: Sequence, outputs: list[int]) -> None:
    """As if the engine computed the prompt and ``outputs`` (all but the last sampled one)."""
    s.output_ids = list(outputs)
    s.num_computed = s.length - 1
    cache.commit(s)
    cache.allocator.free(s.blocks)


def test_idle_blocks_are_evicted_least_recently_released_tail_first() -> None:
    alloc = BlockAllocator(4)
    first = alloc.allocate(2 * BLOCK_SIZE)  # [0, 1]
    assert alloc.register(first[0], b"h0") and alloc.register(first[1], b"h1")
    alloc.free(first)
    assert alloc.free_blocks == 4 and alloc.used_blocks == 0 and alloc.cached_blocks == 2
    taken = alloc.allocate(3 * BLOCK_SIZE)
    assert taken == [2, 3, first[1]]  # free ones first, then the prefix's tail
    assert alloc.evictions == 1
    assert alloc.lookup([b"h0", b"h1"]) == [first[0]]  # h0 survives, h1 is gone


def test_held_blocks_are_never_taken_for_a_new_allocation() -> None:
    alloc = BlockAllocator(4)
    held = alloc.allocate(2 * BLOCK_SIZE)
    for i, block in enumerate(held):
        alloc.register(block, bytes([i]))
    assert not alloc.can_allocate(3 * BLOCK_SIZE)
    with pytest.raises(CapacityExhausted):
        alloc.allocate(3 * BLOCK_SIZE)
    assert set(alloc.allocate(2 * BLOCK_SIZE)).isdisjoint(held)


def test_a_reused_idle_block_does_not_count_as_room_for_the_rest() -> None:
    alloc = BlockAllocator(3)
    blocks = alloc.allocate(3 * BLOCK_SIZE)
    alloc.register(blocks[0], b"p")
    alloc.free(blocks)
    reused = alloc.lookup([b"p"])
    assert reused == [blocks[0]]
    assert alloc.can_allocate(3 * BLOCK_SIZE, reused)  # 1 reused + 2 free
    assert not alloc.can_allocate(4 * BLOCK_SIZE, reused)  # the reused one is not free room
    got = alloc.allocate(3 * BLOCK_SIZE, reused)
    assert got[0] == blocks[0] and alloc.free_blocks == 0


def test_shared_blocks_stay_held_until_their_last_holder_frees_them() -> None:
    alloc = BlockAllocator(4)
    blocks = alloc.allocate(2 * BLOCK_SIZE)
    alloc.register(blocks[0], b"p")
    again = alloc.allocate(2 * BLOCK_SIZE, alloc.lookup([b"p"]))  # a second request reuses it
    assert again[0] == blocks[0] and alloc.used_blocks == 3
    alloc.free(blocks)
    assert alloc.used_blocks == 2  # block 0 still held by the second request
    assert not alloc.can_allocate(3 * BLOCK_SIZE)
    alloc.free(again)
    assert alloc.used_blocks == 0 and alloc.cached_blocks == 1


def test_reset_drops_every_hash_and_frees_idle_blocks() -> None:
    alloc = BlockAllocator(4)
    blocks = alloc.allocate(2 * BLOCK_SIZE)
    alloc.register(blocks[0], b"a")
    alloc.register(blocks[1], b"b")
    alloc.free(blocks[1:])  # block 1 idle, block 0 held
    assert alloc.reset() == 2
    assert alloc.lookup([b"a"]) == [] and alloc.cached_blocks == 0
    alloc.free(blocks[:1])
    assert alloc.free_blocks == 4 and alloc.evictions == 0


def test_first_registration_of_a_prefix_wins() -> None:
    alloc = BlockAllocator(4)
    a, b = alloc.allocate(BLOCK_SIZE), alloc.allocate(BLOCK_SIZE)
    assert alloc.register(a[0], b"same")
    assert not alloc.register(b[0], b"same")  # computed twice at once: the copy stays plain
    alloc.free(b)
    assert alloc.cached_blocks == 1 and alloc.free_blocks == 3


@pytest.mark.parametrize(
    ("prompt_len", "expected"),
    [(16, 0), (17, 1), (32, 1), (33, 2), (40, 2)],
    ids=["one-block", "block+1", "two-blocks", "two-blocks+1", "partial-third"],
)
def test_at_least_one_prompt_token_is_always_computed(prompt_len: int, expected: int) -> None:
    cache = PrefixCache(BlockAllocator(32), CONFIG)
    prompt = list(range(1, 41))
    first = seq(prompt)
    admit(cache, first)
    run_to_end(cache, first, [])  # 39 tokens computed: blocks 0 and 1 cached
    again = seq(prompt[:prompt_len])
    assert len(admit(cache, again)) == expected
    assert again.num_computed == again.cached_tokens == expected * BLOCK_SIZE
    assert again.remaining_prompt >= 1


KEYS = [
    ("base-vs-adapter", None, "abc"),
    ("two-adapters", "abc", "def"),
    ("two-versions", "name-v1-content", "name-v2-content"),
]


@pytest.mark.parametrize(("case", "first", "second"), KEYS, ids=[k[0] for k in KEYS])
def test_blocks_of_another_adapter_content_never_match(
    case: str, first: str | None, second: str | None
) -> None:
    cache = PrefixCache(BlockAllocator(32), CONFIG)
    prompt = list(range(50))
    s = seq(prompt, first)
    admit(cache, s)
    run_to_end(cache, s, [7, 7])
    assert admit(cache, seq(prompt, first)) != []  # the same content hits
    assert admit(cache, seq(prompt, second)) == []  # another one never does


@pytest.mark.parametrize(
    ("field", "a", "b"),
    [("quantization", "none", "int8"), ("quantization", "int8", "int8-dynamic"),
     ("base_identity", "model-a", "model-b")],
)
def test_base_model_and_quantization_are_part_of_the_key(field: str, a: str, b: str) -> None:
    alloc = BlockAllocator(32)
    prompt = list(range(40))
    one = PrefixCache(alloc, CONFIG, **{field: a})  # type: ignore[arg-type]  # field: one of PrefixCache's keywords
    other = PrefixCache(alloc, CONFIG, **{field: b})  # type: ignore[arg-type]  # field: one of PrefixCache's keywords
    s = seq(prompt)
    admit(one, s)
    run_to_end(one, s, [])
    assert one.match(seq(prompt)) and not other.match(seq(prompt))


def test_generated_blocks_are_cached_for_the_next_turn() -> None:
    cache = PrefixCache(BlockAllocator(32), CONFIG)
    prompt, reply = list(range(20)), list(range(100, 120))
    s = seq(prompt, "a", max_tokens=len(reply))
    admit(cache, s)
    run_to_end(cache, s, reply)  # 20 + 19 computed: blocks 0 and 1 full
    turn2 = seq(prompt + reply + [5, 6, 7], "a")
    assert len(admit(cache, turn2)) == 2
    assert cache.stats.hit_tokens == 32 and cache.stats.queried_tokens == 20 + 43


def test_disabled_cache_neither_matches_nor_registers() -> None:
    cache = PrefixCache(BlockAllocator(32), CONFIG, enabled=False)
    prompt = list(range(40))
    s = seq(prompt)
    admit(cache, s)
    run_to_end(cache, s, [1])
    assert cache.allocator.cached_blocks == 0 and admit(cache, seq(prompt)) == []


def test_length_dependent_rope_caches_only_sequences_within_the_original_context() -> None:
    config = ModelConfig(**{**CONFIG.__dict__, "rope_scaling": {
        "rope_type": "longrope", "original_max_position_embeddings": 64,
        "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
    }})
    assert rope_length_limit(config) == 64 and rope_length_limit(CONFIG) is None
    cache = PrefixCache(BlockAllocator(32), config)
    prompt = list(range(40))
    short = seq(prompt, max_tokens=8)
    admit(cache, short)
    run_to_end(cache, short, [1])
    assert admit(cache, seq(prompt, max_tokens=8)) != []
    assert admit(cache, seq(prompt, max_tokens=40)) == []  # could grow past 64: no reuse


def test_many_distinct_prompts_never_grow_past_the_budget() -> None:
    """A hostile pattern: every prompt new. Blocks are recycled from the idle ones, the cache
    never holds more than the pool, and a running sequence's blocks are never handed out."""
    alloc = BlockAllocator(24)
    cache = PrefixCache(alloc, CONFIG)
    rng = random.Random(0)
    long_running = seq(list(range(30)))
    admit(cache, long_running)
    long_running.num_computed = 30
    cache.commit(long_running)
    mine = set(long_running.blocks)
    for _ in range(300):
        s = seq([rng.randrange(256) for _ in range(rng.randrange(2, 60))])
        admit(cache, s)
        assert mine.isdisjoint(s.blocks)
        run_to_end(cache, s, [rng.randrange(256) for _ in range(4)])
        assert alloc.cached_blocks <= alloc.num_blocks
        assert alloc.used_blocks == len(long_running.blocks)
    assert alloc.evictions > 0
    assert admit(cache, seq(list(range(30)))) == long_running.blocks[:1]  # still its own
