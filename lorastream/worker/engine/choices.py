"""n > 1: the choices of one request share its prompt, prefilled once, and its prompt's KV blocks.

A request with n choices is admitted as ONE sequence (choice 0) that reserves the KV blocks of all
n (:func:`reserve_tokens`). It prefills the prompt alone; in the step where its prompt completes,
its last-position logits row is repeated n times and the other n - 1 choices are forked
(:func:`fork_choices`), so each choice samples its first token from the same logits with its own
generator (seed + i) and decodes on its own from then on.

KV blocks, for a prompt of P tokens and B = blocks_for(max_len) blocks per choice::

    full prompt blocks  F = P // BLOCK_SIZE      shared by all n (reference counted)
    tail blocks         T = B - F                one set per choice: the prompt's last, partial
                                                 block (copied from choice 0's) and the output

Example: P = 37, max_len = 37 + 20 = 57, n = 3 -> B = 4, F = 2, T = 2; reserved 4 + 2 * 2 = 8
blocks instead of 12. Choice 0 keeps blocks [a, b, c, d]; choice 1 gets [a, b, e, f] with e a copy
of c (tokens 32-36 of the prompt); choice 2 gets [a, b, g, h] with g a copy of c.
"""

from __future__ import annotations

from collections.abc import Callable

from lorastream.worker.engine.detokenizer import IncrementalDetokenizer, Tokenizer
from lorastream.worker.engine.sampling import make_generator
from lorastream.worker.engine.sequence import ChoiceGroup, Sequence
from lorastream.worker.model.kv_cache import BLOCK_SIZE, BlockAllocator, KVCache

_SEEDS = 2**64


def reserve_tokens(prompt_len: int, max_len: int, n: int) -> int:
    """KV tokens a request reserves at admission: B blocks for choice 0, T more per other one."""
    blocks = BlockAllocator.blocks_for(max_len)
    if n == 1:
        return max_len
    tail = blocks - prompt_len // BLOCK_SIZE
    return (blocks + (n - 1) * tail) * BLOCK_SIZE


def choice_seed(seed: int | None, choice: int) -> int | None:
    """Choice i draws from its own generator, seeded with seed + i (mod 2**64)."""
    return None if seed is None else (seed + choice) % _SEEDS


def fork_choices(
    parent: Sequence, kv: KVCache, tokenizer: Tokenizer
) -> list[Sequence]:
    """Choices 1 .. n-1 of ``parent`` (choice 0), whose prompt was just prefilled.

    Splits the parent's reservation, shares the full prompt blocks (one more hold each) and copies
    the partial prompt block on the device (after this step's forward pass wrote it, before any
    child reads it). The caller acquires their adapter references and runs them.
    """
    group = parent.group
    assert group is not None and not group.forked
    blocks = BlockAllocator.blocks_for(parent.max_len)
    shared = len(parent.prompt_ids) // BLOCK_SIZE
    tail = blocks - shared
    extra = parent.blocks[blocks:]
    parent.blocks = parent.blocks[:blocks]
    kv.allocator.share(parent.blocks[:shared], group.n - 1)
    partial = len(parent.prompt_ids) % BLOCK_SIZE != 0
    children = []
    for choice in range(1, group.n):
        own = extra[(choice - 1) * tail : choice * tail]
        if partial:
            copy_block(kv, parent.blocks[shared], own[0])
        children.append(Sequence(
            request_id=parent.request_id,
            prompt_ids=parent.prompt_ids,
            params=parent.params,
            adapter_id=parent.adapter_id,
            stream=parent.stream,
            detokenizer=IncrementalDetokenizer(
                tokenizer, parent.prompt_ids, stop=parent.params.stop
            ),
            generator=make_generator(choice_seed(parent.params.seed, choice)),
            max_len=parent.max_len,
            eos_ids=parent.eos_ids,
            num_computed=len(parent.prompt_ids),
            blocks=parent.blocks[:shared] + own,
            slot=parent.slot,
            mix=parent.mix,
            mix_slots=parent.mix_slots,
            lora_from=parent.lora_from,
            arrival=parent.arrival,
            choice=choice,
            group=group,
            # structured outputs: each choice walks the grammar on its own (parent at its start)
            matcher=parent.matcher.fork() if parent.matcher is not None else None,
        ))
    group.members.extend(children)
    group.forked = True
    return children


def copy_block(kv: KVCache, src: int, dst: int) -> None:
    """Every layer's K and V of block ``src`` into block ``dst`` (on the device, no sync)."""
    kv.k[:, dst].copy_(kv.k[:, src])  # [L, BLOCK_SIZE, kv_heads, head_dim]
    kv.v[:, dst].copy_(kv.v[:, src])


def expand_for_choices(
    samplers: list[Sequence], fork: Callable[[Sequence], list[Sequence]]
) -> tuple[list[Sequence], list[int] | None]:
    """The step's sampling sequences with each forking parent followed by its new choices, and
    the logits row of each (None when nothing forked: the rows are the samplers themselves)."""
    sequences: list[Sequence] = []
    rows: list[int] = []
    forked = False
    for row, seq in enumerate(samplers):
        sequences.append(seq)
        rows.append(row)
        if seq.group is not None and not seq.group.forked:
            children = fork(seq)
            sequences += children
            rows += [row] * len(children)
            forked = True
    return sequences, rows if forked else None


def new_group(n: int, prompt_len: int, max_len: int) -> ChoiceGroup | None:
    """The group of a request with ``n`` choices (None for n = 1)."""
    if n == 1:
        return None
    return ChoiceGroup(n, reserve_tokens(prompt_len, max_len, n))

