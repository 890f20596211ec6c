"""Prefix caching seen from the gateway: ``usage.prompt_tokens_details.cached_tokens`` (as OpenAI
and vLLM report it) through the worker's gRPC stream, whole and streamed; the operator reset;
and routing that sends a conversation's next turn to the worker holding its prefix, within the
router's load bound (measured against routing without it)."""

from __future__ import annotations

import random

import pytest

from lorastream.core.generation import PromptInput
from lorastream.gateway.routing import (
    PrefixAffinity,
    Router,
    RouteReason,
    Tier,
    WorkerView,
    prefix_key,
)
from tests.gateway.conftest import BASE, TOKEN, Cluster, ClusterFactory

SYSTEM = "You answer questions about the weather in a calm, even, friendly tone. " * 2


@pytest.fixture(scope="module")
def one_worker(cluster_factory: ClusterFactory) -> Cluster:
    return cluster_factory(workers=1)


@pytest.mark.parametrize("model", [BASE, "attn-r4"])
def test_a_repeated_system_prompt_reports_its_cached_tokens(
    one_worker: Cluster, model: str
) -> None:
    client = one_worker.gateway.openai()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": model}]
    replies = [
        client.chat.completions.create(
            model=model, messages=messages, max_tokens=4, temperature=0,  # type: ignore[arg-type]  # plain dicts, not openai's TypedDicts
        )
        for _ in range(2)
    ]
    first, second = (r.usage for r in replies)
    assert first is not None and second is not None
    assert first.prompt_tokens_details is not None and second.prompt_tokens_details is not None
    assert first.prompt_tokens_details.cached_tokens == 0
    cached = second.prompt_tokens_details.cached_tokens
    assert cached is not None and len(SYSTEM) <= cached < second.prompt_tokens
    assert cached % 16 == 0  # whole KV blocks
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content


def test_streamed_usage_reports_cached_tokens(one_worker: Cluster) -> None:
    client = one_worker.gateway.openai()
    prompt = SYSTEM + "Tomorrow?"
    client.completions.create(model=BASE, prompt=prompt, max_tokens=2, temperature=0)
    chunks = list(client.completions.create(
        model=BASE, prompt=prompt, max_tokens=2, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 16 * 16


def test_the_operator_reset_empties_every_workers_prefix_cache(one_worker: Cluster) -> None:
    client = one_worker.gateway.openai()
    prompt = SYSTEM + "Reset?"

    def cached() -> int:
        reply = client.completions.create(model=BASE, prompt=prompt, max_tokens=1, temperature=0)
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        return int(reply.usage.prompt_tokens_details.cached_tokens or 0)

    cached()
    assert cached() > 0
    assert one_worker.gateway.http().post("/v1/prefix-cache/reset").status_code == 401
    reply = one_worker.gateway.http(TOKEN).post("/v1/prefix-cache/reset")
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"reset": [one_worker.workers[0].target], "errors": {}}
    assert cached() == 0


# -- routing ---------------------------------------------------------------------------------
W = ["w1:1", "w2:1", "w3:1"]


def workers(loads: list[int], holders: dict[int, Tier] | None = None) -> list[WorkerView]:
    holders = {i: Tier.DEVICE for i in range(len(loads))} if holders is None else holders
    return [WorkerView(W[i], True, load, {"m": holders[i]} if i in holders else {})
            for i, load in enumerate(loads)]


def test_prefix_key_is_the_same_for_every_turn_of_a_conversation() -> None:
    system = ("system", "x" * 3000)
    turn1 = PromptInput(messages=(system, ("user", "hi")))
    turn2 = PromptInput(messages=(system, ("user", "hi"), ("assistant", "yo"), ("user", "?")))
    other = PromptInput(messages=(("system", "y" * 3000), ("user", "hi")))
    assert prefix_key(turn1) == prefix_key(turn2) != prefix_key(other)
    ids = tuple(range(600))
    assert prefix_key(PromptInput(token_ids=ids)) == prefix_key(PromptInput(token_ids=ids + (7,)))
    long_a = prefix_key(PromptInput(text="a" * 2048 + "b"))
    assert long_a == prefix_key(PromptInput(text="a" * 3000))


def test_the_worker_that_served_a_prefix_gets_its_next_turn_within_the_bound() -> None:
    router = Router(spill_threshold=2)
    first = router.choose("m", workers([0, 0, 0]), prefix="p")
    again = [0, 0, 0]
    again[W.index(first.target)] = 2  # busier, but within the bound (least 0 + 2)
    decision = router.choose("m", workers(again), prefix="p")
    assert decision.target == first.target and decision.reason is RouteReason.PREFIX
    again[W.index(first.target)] = 3  # past the bound: load awareness wins
    spilled = router.choose("m", workers(again), prefix="p")
    assert spilled.target != first.target and spilled.reason is RouteReason.DEVICE
    assert router.choose("m", workers([0, 0, 0]), prefix="p").target == spilled.target


def test_affinity_needs_the_adapter_on_the_worker_but_not_for_the_base_model() -> None:
    router = Router()
    router.affinity.served("m", "p", W[2])
    decision = router.choose("m", workers([0, 0, 0], {0: Tier.DEVICE}), prefix="p")
    assert decision.target == W[0] and decision.reason is RouteReason.DEVICE  # w3 dropped m
    plain = router.choose("base", workers([0, 0, 0], {}), base_model=True).target
    other = next(w for w in W if w != plain)
    router.affinity.served("base", "q", other)
    base = router.choose("base", workers([0, 0, 0], {}), base_model=True, prefix="q")
    assert base.target == other and base.reason is RouteReason.PREFIX
    # the worker the rules pick anyway keeps its reason: PREFIX counts only what affinity moved
    router.affinity.served("base", "r", plain)
    same = router.choose("base", workers([0, 0, 0], {}), base_model=True, prefix="r")
    assert same.target == plain and same.reason is RouteReason.LEAST_LOADED


def test_the_affinity_table_is_bounded_least_recently_used_first() -> None:
    table = PrefixAffinity(capacity=3)
    for i in range(5):
        table.served("m", f"p{i}", W[0])
    table.served("m", "p2", W[1])  # used again: kept
    table.served("m", "p5", W[2])
    assert len(table) == 3 and table.last("m", "p2") == W[1]
    assert table.last("m", "p0") is None and table.last("m", "p3") is None
    assert not PrefixAffinity(capacity=0).last("m", "p")


def simulate(router: Router, seed: int = 3) -> tuple[float, int]:
    """48 conversations of 4 turns over 8 adapters resident on 3 workers, turns interleaved;
    each worker's load is what the simulation has in flight (requests end at random). Returns
    the share of turns 2-4 sent to the worker that served the previous turn (its prefix cache
    holds the conversation), and the largest excess of a chosen worker's load over the least
    loaded one's."""
    rng = random.Random(seed)
    inflight = {w: 0 for w in W}
    last: dict[int, str] = {}
    turns = [c for c in range(48) for _ in range(4)]
    rng.shuffle(turns)
    seen: dict[int, int] = {}
    warm = later = excess = 0
    for conv in turns:
        for w in W:  # some requests finish
            inflight[w] -= sum(rng.random() < 0.3 for _ in range(inflight[w]))
        model = f"a{conv % 8}"
        views = [WorkerView(w, True, inflight[w], {model: Tier.DEVICE}) for w in W]
        decision = router.choose(model, views, prefix=f"conv-{conv}")
        excess = max(excess, inflight[decision.target] - min(inflight.values()))
        seen[conv] = seen.get(conv, 0) + 1
        if seen[conv] > 1:
            later += 1
            warm += decision.target == last[conv]
        last[conv] = decision.target
        inflight[decision.target] += 1
    return warm / later, excess


def test_prefix_routing_keeps_conversations_on_their_worker_more_than_without_it() -> None:
    with_prefix, excess = simulate(Router(spill_threshold=2))
    without, excess_before = simulate(Router(spill_threshold=2, prefix_table=0))
    assert with_prefix >= 0.8 and with_prefix > without + 0.2, (with_prefix, without)
    assert excess <= 2 and excess_before <= 2  # the load bound holds either way
