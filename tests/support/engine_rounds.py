"""Two rounds of greedy requests through one engine, every token checked against a reference."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lorastream.core.generation import PromptInput, SamplingParams
from lorastream.worker.engine.engine import Engine


def two_rounds_match(
    engine: Engine, names: Sequence[str], prompts: Sequence[Sequence[int]], new_tokens: int,
    reference: Mapping[tuple[str, int], list[int]], label: str,
) -> dict[tuple[str, int], int]:
    """Submit every (name, prompt) twice (the engine starts after the first round is queued, so
    it runs as one mixed batch); assert each request's greedy tokens are ``reference``'s; return
    the prompt tokens the second round took from the prefix cache, per (name, prompt)."""
    keys = [(name, i) for name in names for i in range(len(prompts))]
    cached: dict[tuple[str, int], int] = {}
    for round_ in range(2):
        streams = {
            key: engine.submit(key[0], PromptInput(token_ids=tuple(prompts[key[1]])),
                               SamplingParams(max_tokens=new_tokens))
            for key in keys
        }
        if round_ == 0:
            engine.start()
        for key, stream in streams.items():
            events = list(stream)
            tokens = [t for event in events for t in event.token_ids]
            assert tokens == reference[key], f"{label} {key} round {round_}"
            cached[key] = events[-1].cached_tokens
    return cached
