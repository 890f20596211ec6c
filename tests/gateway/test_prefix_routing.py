"""Prefix caching seen from the gateway: ``usage.prompt_tokens_details.cached_tokens`` (as OpenAI
and vLLM report it) through the worker's gRPC stream, whole and streamed; the operator reset;
and routing that sends a conversation's next turn to the worker holding its prefix, within the
router's load bound (measured against routing without it)."""

from __future__ import annotations

import asyncio
import random

import pytest

from lorastream.core.generation import PromptInput
from lorastream.gateway.app import build_state
from lorastream.gateway.config import GatewaySettings
from lorastream.gateway.metrics import GatewayMetrics
from lorastream.gateway.prefix_affinity import (
    CHUNK_CHARS,
    CHUNK_TOKENS,
    MAX_CHUNKS,
    PrefixAffinity,
    prefix_keys,
    recorded_keys,
)
from lorastream.gateway.routing import Router, RouteReason, Tier, WorkerView
from tests.gateway.conftest import BASE, TOKEN, Cluster, ClusterFactory, wait_until

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


@pytest.mark.parametrize("entries", [4096, 0])
def test_the_next_turn_goes_where_the_last_one_was_cached_only_with_affinity(
    cluster_factory: ClusterFactory, entries: int
) -> None:
    """Live, two workers: turn 1 lands on the worker that is not the base model's home (the home
    is busy with a long stream); with equal queues again, turn 2 goes back to that worker and
    reuses its cache with prefix affinity, and to the home, cold, without it."""
    cluster = cluster_factory(workers=2, prefix_affinity_entries=entries)
    client = cluster.gateway.openai()
    idle = cluster.finished_counts()
    client.completions.create(model=BASE, prompt="Where am I?", max_tokens=1, temperature=0)
    home = next(t for t, n in cluster.serving(idle).items() if n == 1)
    other = next(w.target for w in cluster.workers if w.target != home)
    conversation = SYSTEM * 2 + "User: is it raining?\nAssistant:"  # 2 x 142 characters + 31
    with client.completions.create(model=BASE, prompt="Tell a long story.", max_tokens=1500,
                                   temperature=0, stream=True, extra_body={"ignore_eos": True},
                                   ) as long_stream:
        next(iter(long_stream))  # running on the home worker: its queue is 1 deeper
        before = cluster.finished_counts()
        turn1 = client.completions.create(model=BASE, prompt=conversation, max_tokens=4,
                                          temperature=0)
        assert cluster.serving(before) == {home: 0, other: 1}
    assert wait_until(lambda: all(cluster.worker(t).idle() for t in (home, other)), 30)
    pool = cluster.gateway.state.pool
    assert wait_until(lambda: all(v.load == 0 for v in pool.views()))  # a poll saw it end
    before = cluster.finished_counts()
    turn2 = client.completions.create(
        model=BASE, prompt=conversation + turn1.choices[0].text + "\nUser: and now?\nAssistant:",
        max_tokens=4, temperature=0)
    assert turn2.usage is not None and turn2.usage.prompt_tokens_details is not None
    cached = turn2.usage.prompt_tokens_details.cached_tokens or 0
    if entries:
        assert cluster.serving(before) == {home: 0, other: 1}
        assert cached >= len(SYSTEM) * 2 // 16 * 16 - 16  # the conversation so far, whole blocks
    else:
        assert cluster.serving(before) == {home: 1, other: 0}
        assert cached == 0


# -- routing ---------------------------------------------------------------------------------
W = ["w1:1", "w2:1", "w3:1"]


def workers(loads: list[int], holders: dict[int, Tier] | None = None) -> list[WorkerView]:
    holders = {i: Tier.DEVICE for i in range(len(loads))} if holders is None else holders
    return [WorkerView(W[i], True, load, {"m": holders[i]} if i in holders else {})
            for i, load in enumerate(loads)]


def test_a_turn_shares_every_key_of_the_last_turn_and_another_conversation_only_its_start(
) -> None:
    system = ("system", "x" * 3000)
    turn1 = PromptInput(messages=(system, ("user", "hi" * 40)))
    turn2 = PromptInput(messages=(system, ("user", "hi" * 40), ("assistant", "yo"), ("user", "?")))
    other = PromptInput(messages=(system, ("user", "ho" * 40)))
    elsewhere = PromptInput(messages=(("system", "y" * 3000), ("user", "hi" * 40)))
    keys1, keys2 = prefix_keys(turn1), prefix_keys(turn2)
    assert len(keys1) == (7 + 3000 + 5 + 80 + 2) // CHUNK_CHARS  # whole chunks only
    assert keys2[-len(keys1):] == keys1  # the longest prefix first: turn 1's keys at the end
    assert keys1[0] not in prefix_keys(other)  # turn 1's own last chunk: this conversation's
    assert keys1[-1] in prefix_keys(other)  # the system prompt's start: shared
    assert not set(keys1) & set(prefix_keys(elsewhere))
    ids = tuple(range(600))
    assert prefix_keys(PromptInput(token_ids=ids)) == prefix_keys(
        PromptInput(token_ids=(*ids, 7)))
    assert prefix_keys(PromptInput(token_ids=ids[:CHUNK_TOKENS - 1])) == ()  # no whole chunk
    assert prefix_keys(PromptInput(text="s" * (CHUNK_CHARS - 1))) == ()
    assert len(prefix_keys(PromptInput(text="s" * 10**6))) == MAX_CHUNKS


def test_a_request_is_remembered_under_its_longest_prefix_and_power_of_two_ones() -> None:
    keys = [f"k{n}" for n in range(11, 0, -1)]  # 11 chunks, the longest first
    assert recorded_keys(keys) == ["k11", "k8", "k4", "k2", "k1"]
    assert recorded_keys(["k1"]) == ["k1"] and recorded_keys([]) == []


def test_two_conversations_behind_one_system_prompt_each_find_their_own_worker() -> None:
    router = Router(spill_threshold=2)
    system = "You are the support assistant of a weather service. " * 40  # 2,080 characters
    a1, b1 = (PromptInput(text=system + f"User: question {c}? " * 4) for c in "ab")
    a = router.choose("m", workers([0, 0, 0]), prefixes=prefix_keys(a1)).target
    b = router.choose("m", workers([3 if w == a else 0 for w in W]),  # a busy: b goes elsewhere
                      prefixes=prefix_keys(b1)).target
    assert a != b
    for conversation, home in ((a1, a), (b1, b)):  # equal queues: each next turn to its own
        turn2 = PromptInput(text=f"{conversation.text}Assistant: sunny. User: and tomorrow?")
        assert router.choose("m", workers([0, 0, 0]), prefixes=prefix_keys(turn2)).target == home
    # a new conversation behind the same system prompt: to a worker that served that prompt
    c1 = PromptInput(text=system + "User: something else entirely")
    assert router.choose("m", workers([0, 0, 0]), prefixes=prefix_keys(c1)).target in (a, b)


def test_the_worker_that_served_a_prefix_gets_its_next_turn_within_the_bound() -> None:
    router = Router(spill_threshold=2)
    first = router.choose("m", workers([0, 0, 0]), prefixes=("p",))
    again = [0, 0, 0]
    again[W.index(first.target)] = 2  # busier, but within the bound (least 0 + 2)
    decision = router.choose("m", workers(again), prefixes=("p",))
    assert decision.target == first.target and decision.reason is RouteReason.PREFIX
    again[W.index(first.target)] = 3  # past the bound: load awareness wins
    spilled = router.choose("m", workers(again), prefixes=("p",))
    assert spilled.target != first.target and spilled.reason is RouteReason.DEVICE
    assert router.choose("m", workers([0, 0, 0]), prefixes=("p",)).target == spilled.target


def test_affinity_needs_the_adapter_on_the_worker_but_not_for_the_base_model() -> None:
    router = Router()
    router.affinity.served("m", ["p"], W[2])
    decision = router.choose("m", workers([0, 0, 0], {0: Tier.DEVICE}), prefixes=("p",))
    assert decision.target == W[0] and decision.reason is RouteReason.DEVICE  # w3 dropped m
    plain = router.choose("base", workers([0, 0, 0], {}), base_model=True).target
    other = next(w for w in W if w != plain)
    router.affinity.served("base", ["q"], other)
    base = router.choose("base", workers([0, 0, 0], {}), base_model=True, prefixes=("q",))
    assert base.target == other and base.reason is RouteReason.PREFIX
    # the worker the rules pick anyway keeps its reason: PREFIX counts only what affinity moved
    router.affinity.served("base", ["r"], plain)
    same = router.choose("base", workers([0, 0, 0], {}), base_model=True, prefixes=("r",))
    assert same.target == plain and same.reason is RouteReason.LEAST_LOADED


def test_the_affinity_table_is_bounded_least_recently_used_first() -> None:
    table = PrefixAffinity(capacity=3)
    for i in range(5):
        table.served("m", [f"p{i}"], W[0])
    table.served("m", ["p2"], W[1])  # used again: kept
    table.served("m", ["p5"], W[2])
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
        decision = router.choose(model, views, prefixes=(f"conv-{conv}",))
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


@pytest.mark.parametrize("entries", [0, 7])
def test_the_gateway_setting_sizes_the_affinity_table(entries: int) -> None:
    async def router_of(settings: GatewaySettings) -> Router:
        state = build_state(settings, GatewayMetrics())
        await state.pool.close()
        return state.router

    settings = GatewaySettings(workers=["127.0.0.1:1"], prefix_affinity_entries=entries)
    router = asyncio.run(router_of(settings))
    assert router.affinity.capacity == entries
    router.affinity.served("m", ["p"], "127.0.0.1:1")
    assert len(router.affinity) == min(entries, 1)  # 0: nothing is remembered
