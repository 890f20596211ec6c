"""n > 1: the prompt is prefilled once, its full KV blocks are shared by the n choices, greedy
choices equal n = 1 (and HF + PEFT), seeded choice i equals a request seeded with seed + i."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorastream.core.errors import InvalidArgument
from lorastream.core.generation import FinishReason, GenerationEvent, PromptInput, SamplingParams
from lorastream.worker.engine.choices import reserve_tokens
from lorastream.worker.model.kv_cache import BLOCK_SIZE, BlockAllocator
from lorastream.worker.service.operations import WorkerOperations
from tests.worker.conftest import EngineFactory, peft_model, reference_greedy

# 5 tokens (one partial block), 16 (exactly one full block: nothing to copy), 37 (two shared
# blocks and a partial one)
CHOICE_PROMPTS = [[5, 9, 33, 41, 7], list(range(60, 76)), [(7 * i) % 200 + 3 for i in range(37)]]


def _choices(events: list[GenerationEvent], n: int) -> tuple[list[list[int]], list[FinishReason]]:
    tokens: list[list[int]] = [[] for _ in range(n)]
    reasons: list[FinishReason] = []
    for event in events:
        tokens[event.index].extend(event.token_ids)
        if event.finish_reason is not None:
            reasons.append(event.finish_reason)
            assert event.completion_tokens == len(tokens[event.index])
    return tokens, reasons


def test_block_allocator_frees_a_shared_block_when_its_last_holder_lets_go() -> None:
    allocator = BlockAllocator(8)
    blocks = allocator.allocate(3 * BLOCK_SIZE)
    allocator.share(blocks[:2], 2)  # three holders of the first two blocks
    allocator.free(blocks)  # holder 1: only blocks[2] comes back
    assert allocator.free_blocks == 6
    allocator.free(blocks[:2])
    assert allocator.free_blocks == 6
    allocator.free(blocks[:2])  # the last holder
    assert allocator.free_blocks == 8 and allocator.used_blocks == 0


@pytest.mark.parametrize(("prompt", "max_len", "n", "blocks"),
                         [(5, 25, 3, 6), (16, 36, 3, 3 + 2 * 2), (37, 57, 3, 8), (4, 9, 1, 1)])
def test_reservation_shares_the_full_prompt_blocks(
    prompt: int, max_len: int, n: int, blocks: int
) -> None:
    assert BlockAllocator.blocks_for(reserve_tokens(prompt, max_len, n)) == blocks


@pytest.mark.parametrize("adapter", ["base", "attn-r4", "all-r64"])
def test_greedy_choices_each_equal_n_1_and_hf_peft_with_the_prompt_prefilled_once(
    engine_factory: EngineFactory, tiny_model: Path, tiny_adapters: dict[str, Path], adapter: str
) -> None:
    engine = engine_factory(start=False)
    model = "tiny" if adapter == "base" else adapter
    if adapter != "base":
        WorkerOperations(engine).load_adapter(adapter, str(tiny_adapters[adapter]))
    streams = [engine.submit(model, PromptInput(token_ids=tuple(p)),
                             SamplingParams(max_tokens=10, n=3)) for p in CHOICE_PROMPTS]
    engine.start()
    results = [_choices(list(stream), 3) for stream in streams]
    reference = peft_model(tiny_model, None if adapter == "base" else tiny_adapters[adapter])
    for prompt, (tokens, reasons) in zip(CHOICE_PROMPTS, results, strict=True):
        expected = reference_greedy(reference, prompt, 10)
        assert tokens == [expected] * 3
        assert len(reasons) == 3
    assert engine.stats.prefill_tokens == sum(len(p) for p in CHOICE_PROMPTS)  # once each
    assert engine.stats.finished_requests == len(CHOICE_PROMPTS)


def test_seeded_choice_i_equals_a_request_seeded_with_seed_plus_i(
    engine_factory: EngineFactory,
) -> None:
    engine = engine_factory()
    prompt = PromptInput(token_ids=tuple(CHOICE_PROMPTS[2]))
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=41, ignore_eos=True)
    tokens, reasons = _choices(list(engine.submit("tiny", prompt, SamplingParams(
        **{**sampled.__dict__, "n": 4}))), 4)
    alone = [
        [t for e in engine.submit("tiny", prompt, SamplingParams(
            **{**sampled.__dict__, "seed": 41 + i})) for t in e.token_ids]
        for i in range(4)
    ]
    assert tokens == alone
    assert len({tuple(t) for t in tokens}) > 1  # the choices differ: each has its own generator
    assert reasons == [FinishReason.LENGTH] * 4


def test_a_cancelled_request_ends_every_choice_and_frees_the_shared_blocks(
    engine_factory: EngineFactory,
) -> None:
    engine = engine_factory()
    stream = engine.submit("tiny", PromptInput(token_ids=tuple(CHOICE_PROMPTS[2])),
                           SamplingParams(max_tokens=200, n=3, ignore_eos=True))
    first = next(stream)
    assert first.token_ids
    stream.cancel()
    rest = list(stream)
    reasons = [e.finish_reason for e in rest if e.finish_reason is not None]
    assert reasons and set(reasons) <= {FinishReason.CANCELLED, FinishReason.LENGTH}
    assert len(reasons) == 3
    # engine_factory's teardown checks that no KV block or adapter reference leaked


def test_too_many_choices_are_refused_naming_n(engine_factory: EngineFactory) -> None:
    engine = engine_factory()
    with pytest.raises(InvalidArgument, match="n \\(the number of choices\\) must be in"):
        engine.submit("tiny", PromptInput(token_ids=(5, 6)), SamplingParams(n=17))
