"""The router on plain views of workers: residency order, hash stability, load, health."""

from __future__ import annotations

import hashlib
import random
from collections import deque
from dataclasses import dataclass, field

import pytest

from lorastream.core.errors import CapacityExhausted
from lorastream.gateway.errors import NoHealthyWorker
from lorastream.gateway.routing import (
    RouteDecision,
    Router,
    RouteReason,
    Tier,
    WorkerView,
    hrw_score,
)

TARGETS = [f"10.0.0.{i}:50052" for i in range(1, 6)]


def views(
    loads: list[int],
    residency: dict[int, Tier] | None = None,
    unhealthy: tuple[int, ...] = (),
    model: str = "m",
) -> list[WorkerView]:
    """Workers 0..n-1 with ``loads``; ``residency`` maps worker index -> tier of ``model``."""
    residency = residency or {}
    return [
        WorkerView(TARGETS[i], i not in unhealthy, load,
                   {model: residency[i]} if i in residency else {})
        for i, load in enumerate(loads)
    ]


def hash_home(model: str, indices: list[int]) -> int:
    return max(indices, key=lambda i: hrw_score(model, TARGETS[i]))


@pytest.mark.parametrize(
    ("loads", "residency", "expected", "reason"),
    [
        # device beats host beats nothing, at equal load
        ([0, 0, 0], {0: Tier.HOST, 1: Tier.DEVICE}, 1, RouteReason.DEVICE),
        ([0, 0, 0], {2: Tier.HOST}, 2, RouteReason.HOST),
        # a resident worker wins while within the spill threshold of the least loaded one
        ([8, 0, 0], {0: Tier.DEVICE}, 0, RouteReason.DEVICE),
        ([3, 0, 0], {0: Tier.DEVICE, 1: Tier.HOST}, 0, RouteReason.DEVICE),
        # among several device holders, the least loaded
        ([5, 2, 0], {0: Tier.DEVICE, 1: Tier.DEVICE}, 1, RouteReason.DEVICE),
        # a device holder past the threshold spills to the host holder
        ([9, 4, 0], {0: Tier.DEVICE, 1: Tier.HOST}, 1, RouteReason.HOST),
    ],
)
def test_residency_is_preferred_device_then_host(
    loads: list[int], residency: dict[int, Tier], expected: int, reason: RouteReason
) -> None:
    decision = Router(spill_threshold=8).choose("m", views(loads, residency))
    assert (decision.target, decision.reason) == (TARGETS[expected], reason)


def test_a_hot_adapter_spills_to_the_least_loaded_worker_when_every_holder_is_overloaded() -> None:
    decision = Router(spill_threshold=2).choose("m", views([9, 7, 1], {0: Tier.DEVICE}))
    assert decision.reason in (RouteReason.HASH, RouteReason.LEAST_LOADED)
    assert decision.target == TARGETS[2]


@pytest.mark.parametrize("model", [f"adapter-{i}" for i in range(8)])
def test_a_cold_adapter_goes_to_its_hash_home_and_stays_there(model: str) -> None:
    router = Router()
    workers = views([0, 0, 0, 0], model=model)
    first = router.choose(model, workers)
    assert first.reason is RouteReason.HASH
    assert first.target == TARGETS[hash_home(model, [0, 1, 2, 3])]
    assert all(router.choose(model, workers) == first for _ in range(20))


@pytest.mark.parametrize("workers_before", [2, 3, 4])
def test_adding_a_worker_moves_about_one_in_n_adapters_and_only_to_it(workers_before: int) -> None:
    router = Router()
    models = [f"tenant-{i}/adapter" for i in range(2000)]
    before = views([0] * workers_before)
    after = views([0] * (workers_before + 1))
    new_target = TARGETS[workers_before]
    moved = [m for m in models
             if router.choose(m, before).target != router.choose(m, after).target]
    share = len(moved) / len(models)
    expected = 1 / (workers_before + 1)
    assert expected * 0.8 < share < expected * 1.2, share
    assert all(router.choose(m, after).target == new_target for m in moved)


@pytest.mark.parametrize(
    ("loads", "spill", "expect_hash_home"),
    [
        ([0, 0, 0], 0, True),  # equal loads: the hash decides
        ([2, 2, 2], 0, True),
        ([4, 1, 1], 8, True),  # within the threshold: still the hash home
        ([4, 1, 1], 2, False),  # past it: the least loaded
    ],
)
def test_least_loaded_ties_are_broken_by_the_hash(
    loads: list[int], spill: int, expect_hash_home: bool
) -> None:
    model = "tie"
    home = hash_home(model, [0, 1, 2])
    loads = [loads[0] if i == home else loads[1] for i in range(3)]
    decision = Router(spill_threshold=spill).choose(model, views(loads, model=model))
    assert (decision.target == TARGETS[home]) is expect_hash_home


def test_past_the_threshold_the_least_loaded_worker_wins_ties_by_hash() -> None:
    model = "busy"
    home = hash_home(model, [0, 1, 2])
    others = [i for i in range(3) if i != home]
    loads = [10 if i == home else 1 for i in range(3)]
    decision = Router(spill_threshold=2).choose(model, views(loads, model=model))
    assert decision.reason is RouteReason.LEAST_LOADED
    assert decision.target == TARGETS[hash_home(model, others)]


def test_the_base_model_goes_to_the_least_loaded_worker() -> None:
    decision = Router().choose("tiny", views([3, 1, 2]), base_model=True)
    assert (decision.target, decision.reason) == (TARGETS[1], RouteReason.LEAST_LOADED)


@pytest.mark.parametrize(
    ("unhealthy", "exclude", "residency"),
    [
        ((0,), (), {0: Tier.DEVICE}),  # the device holder is down
        ((), (TARGETS[0],), {0: Tier.DEVICE}),  # ... or just failed this request
        ((0, 1), (), {0: Tier.DEVICE, 1: Tier.HOST}),
    ],
)
def test_unhealthy_and_excluded_workers_are_skipped(
    unhealthy: tuple[int, ...], exclude: tuple[str, ...], residency: dict[int, Tier]
) -> None:
    workers = views([0, 0, 0, 0], residency, unhealthy)
    skipped = {TARGETS[i] for i in unhealthy} | set(exclude)
    for model in ("m", "other", "third"):
        assert Router().choose(model, workers, exclude=exclude).target not in skipped


@pytest.mark.parametrize(
    ("unhealthy", "exclude"), [((0, 1), ()), ((0,), (TARGETS[1],)), ((), tuple(TARGETS[:2]))]
)
def test_no_healthy_worker_left_is_an_error(
    unhealthy: tuple[int, ...], exclude: tuple[str, ...]
) -> None:
    with pytest.raises(NoHealthyWorker, match="no healthy worker"):
        Router().choose("m", views([0, 0], unhealthy=unhealthy), exclude=exclude)


def test_full_workers_are_skipped_and_all_full_is_capacity_exhausted() -> None:
    router = Router(max_load=4)
    assert router.choose("m", views([4, 3], {0: Tier.DEVICE})).target == TARGETS[1]
    with pytest.raises(CapacityExhausted, match="retry later"):
        router.choose("m", views([4, 5]))


def test_hrw_scores_do_not_depend_on_the_process() -> None:
    # Python's hash() is salted per process; the score is a plain blake2b of model and target.
    expected = int.from_bytes(hashlib.blake2b(b"a\0b", digest_size=8).digest(), "big")
    assert hrw_score("a", "b") == expected


# -- load-aware affinity ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("loads", "spill", "fraction", "expected", "reason"),
    [
        # idle workers: the floor decides (2 requests)
        ([2, 0, 0], 2, 0.25, 0, RouteReason.DEVICE),
        ([3, 0, 0], 2, 0.25, None, RouteReason.HASH),  # past it: the hash home among the rest
        # busy workers: a quarter of the mean (37.3 -> 9.3; 40 -> 10)
        ([40, 36, 36], 2, 0.25, 0, RouteReason.DEVICE),
        ([48, 36, 36], 2, 0.25, None, RouteReason.HASH),
        # fraction 0: the threshold alone, however busy
        ([40, 36, 36], 2, 0.0, None, RouteReason.HASH),
    ],
)
def test_a_holder_wins_while_within_the_threshold_or_the_fraction_of_the_mean_queue(
    loads: list[int], spill: int, fraction: float, expected: int | None, reason: RouteReason
) -> None:
    model = "bound"
    others = [i for i in range(3) if i != 0]
    router = Router(spill_threshold=spill, spill_fraction=fraction)
    decision = router.choose(model, views(loads, {0: Tier.DEVICE}, model=model))
    home = expected if expected is not None else hash_home(model, others)
    assert (decision.target, decision.reason) == (TARGETS[home], reason)


@dataclass
class ClosedLoop:
    """Workers behind one router, as the gateway's pool shows them: a request adds one to its
    worker's load until it finishes; a worker holds an adapter in host memory from the moment a
    request for it is routed there (the pool's routing hint) while it is among the last
    ``host_slots`` adapters routed there, and on the device among the last ``device_slots``."""

    router: Router
    targets: list[str]
    device_slots: int = 2
    host_slots: int = 8
    loads: dict[str, int] = field(default_factory=dict)
    host: dict[str, list[str]] = field(default_factory=dict)  # least recently used first
    device: dict[str, list[str]] = field(default_factory=dict)
    in_flight: deque[str] = field(default_factory=deque)

    def __post_init__(self) -> None:
        for target in self.targets:
            self.loads.setdefault(target, 0)
            self.host.setdefault(target, [])
            self.device.setdefault(target, [])

    def views(self) -> list[WorkerView]:
        return [
            WorkerView(t, True, self.loads[t],
                       {**{m: Tier.HOST for m in self.host[t]},
                        **{m: Tier.DEVICE for m in self.device[t]}})
            for t in self.targets
        ]

    def start(self, model: str, target: str | None = None) -> str:
        """Route (or place, with ``target``) one request for ``model``; returns its worker."""
        target = target or self.router.choose(model, self.views()).target
        self.loads[target] += 1
        self.in_flight.append(target)
        for cache, slots in ((self.host[target], self.host_slots),
                             (self.device[target], self.device_slots)):
            if model in cache:
                cache.remove(model)
            cache.append(model)
            del cache[:-slots]
        return target

    def finish_oldest(self) -> None:
        self.loads[self.in_flight.popleft()] -= 1

    def gap(self) -> int:
        return max(self.loads.values()) - min(self.loads.values())


ADAPTERS = [f"tenant-{i}/adapter" for i in range(20)]


def zipf_models(rng: random.Random, n: int) -> list[str]:
    """``n`` requests' adapters, zipf over ADAPTERS (the first is the most popular)."""
    return rng.choices(ADAPTERS, weights=[1 / (rank + 1) for rank in range(len(ADAPTERS))], k=n)


@pytest.mark.parametrize(("spill", "fraction"), [(2, 0.25), (0, 0.5), (8, 0.0), (4, 0.1)])
@pytest.mark.parametrize("workers", [2, 3, 5])
def test_a_hot_adapter_never_makes_its_holder_deeper_than_the_bound(
    spill: int, fraction: float, workers: int
) -> None:
    """Every request is for one adapter held only by worker 0, and none finishes: no queue ever
    grows past the bound of the shortest one (+1, the request that crossed it)."""
    router = Router(spill_threshold=spill, spill_fraction=fraction)
    loads = [0] * workers
    for _ in range(200):
        slack = router.bound(0, sum(loads) / workers)
        decision = router.choose("hot", views(loads, {0: Tier.DEVICE}, model="hot"))
        loads[TARGETS.index(decision.target)] += 1
        assert max(loads) - min(loads) <= slack + 1, loads
    assert min(loads) > 0  # the hot adapter spilled onto every worker


def restarted_cluster(router: Router, concurrency: int, models: list[str]) -> ClosedLoop:
    """Workers 0 and 1 hold every adapter and share ``concurrency`` requests (for ``models``);
    worker 2 is back from a restart with nothing."""
    loop = ClosedLoop(router, TARGETS[:3], host_slots=len(ADAPTERS))
    for target in TARGETS[:2]:
        loop.host[target] = list(ADAPTERS)
    for i, model in enumerate(models):
        loop.start(model, TARGETS[i % 2])
    return loop


def after_restart(router: Router, concurrency: int, seed: int) -> tuple[list[str], ClosedLoop]:
    """The workers chosen for the 36 requests that follow the restart (closed loop: one
    finishes, the next starts), and the loop as they leave it."""
    rng = random.Random(seed)
    loop = restarted_cluster(router, concurrency, zipf_models(rng, concurrency))
    assert loop.loads[TARGETS[2]] == 0 and not loop.host[TARGETS[2]]
    chosen = []
    for model in zipf_models(rng, 36):
        loop.finish_oldest()
        chosen.append(loop.start(model))
    return chosen, loop


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    ("concurrency", "at_least"),
    [
        # 4 requests a worker: a holder 2 (spill_threshold) deeper than the restarted worker is
        # not hot, so it gets about a quarter of the traffic rather than a third
        (12, 9),
        (24, 12),  # from 8 a worker on: at least its fair third
        (48, 12),
        (96, 12),
    ],
)
def test_a_restarted_empty_worker_takes_its_share_within_a_few_dozen_requests(
    concurrency: int, at_least: int, seed: int
) -> None:
    """Zipf over 20 adapters, all held by workers 0 and 1: of the 36 requests after the restart
    the empty worker 2 gets ``at_least``, then holds adapters of its own, and its queue is within
    ``spill_threshold`` of the mean (the old rule left it at 0 of 36 at concurrency 12)."""
    router = Router()
    chosen, loop = after_restart(router, concurrency, seed)
    assert chosen.count(TARGETS[2]) >= at_least, chosen.count(TARGETS[2])
    assert loop.loads[TARGETS[2]] >= concurrency / 3 - router.spill_threshold, loop.loads
    assert len(loop.host[TARGETS[2]]) >= 2


def test_the_old_residency_first_rule_starved_a_restarted_worker() -> None:
    """The rule this replaced (a fixed threshold of 8 over the least loaded queue) fails the
    same scenario at 4 requests a worker: every request stays on the holders."""
    chosen, loop = after_restart(Router(spill_threshold=8, spill_fraction=0.0), 12, seed=0)
    assert chosen.count(TARGETS[2]) == 0 and loop.loads[TARGETS[2]] == 0, loop.loads


@pytest.mark.parametrize("concurrency", [6, 12, 24, 48, 96])
def test_after_a_restart_no_queue_stays_deeper_than_the_bound(concurrency: int) -> None:
    """At any load, 36 requests after the restart the gap between the queues is within the
    bound (+1)."""
    router = Router()
    _, loop = after_restart(router, concurrency, seed=concurrency)
    assert loop.gap() <= router.bound(0, concurrency / 3) + 1, loop.loads


@pytest.mark.parametrize("load", [0, 1, 5, 40])
@pytest.mark.parametrize("tier", [Tier.DEVICE, Tier.HOST])
@pytest.mark.parametrize("model", ["m", "tenant-3/adapter", "x"])
def test_with_equal_loads_an_adapter_keeps_landing_on_its_holder(
    load: int, tier: Tier, model: str
) -> None:
    """Whatever the hash says, and however busy the workers, equal queues never move an adapter
    off the worker that holds it."""
    router = Router()
    holder = next(i for i in range(4) if i != hash_home(model, [0, 1, 2, 3]))
    workers = views([load] * 4, {holder: tier}, model=model)
    decisions = {router.choose(model, workers) for _ in range(20)}
    assert decisions == {RouteDecision(TARGETS[holder], RouteReason(tier.name.lower()))}


def hit_rate(router: Router, concurrency: int, requests: int = 500) -> float:
    """Share of requests routed to a worker already holding their adapter, in a warm closed
    loop of 3 workers whose host memory holds 6 of the 20 adapters each."""
    rng = random.Random(concurrency)
    loop = ClosedLoop(router, TARGETS[:3], host_slots=6)
    warm_up = 100 + concurrency
    hits = 0
    for i, model in enumerate(zipf_models(rng, warm_up + requests)):
        if i >= concurrency:
            loop.finish_oldest()
        held = {t: model in loop.host[t] for t in loop.targets}
        target = loop.start(model)
        hits += held[target] and i >= warm_up
    return hits / requests


@pytest.mark.parametrize("concurrency", [3, 12, 48])
def test_load_awareness_keeps_most_requests_on_a_worker_holding_their_adapter(
    concurrency: int,
) -> None:
    """Steady state with every worker warm: the bound does not scatter the adapters. Most
    requests find their adapter where they land, far more than under least-loaded routing."""
    affinity = hit_rate(Router(), concurrency)
    least_loaded = hit_rate(Router(spill_threshold=0, spill_fraction=0.0), concurrency)
    assert affinity >= 0.7, affinity
    assert affinity >= least_loaded + 0.15, (affinity, least_loaded)


# -- policy "random": the baseline of `lorastream bench fleet` ---------------------------------
@pytest.mark.parametrize(
    ("loads", "residency", "unhealthy", "max_load", "eligible"),
    [
        ([0, 0, 0], {0: Tier.DEVICE}, (), None, {0, 1, 2}),  # residency is ignored
        ([9, 0, 0], {0: Tier.DEVICE}, (), None, {0, 1, 2}),  # so is the load bound
        ([0, 0, 0, 0], {}, (1,), None, {0, 2, 3}),  # unhealthy workers are not candidates
        ([4, 1, 4], {2: Tier.HOST}, (), 4, {1}),  # nor full ones
    ],
)
def test_random_policy_picks_uniformly_among_healthy_workers_under_max_load(
    loads: list[int], residency: dict[int, Tier], unhealthy: tuple[int, ...],
    max_load: int | None, eligible: set[int],
) -> None:
    router = Router(max_load=max_load, policy="random", rng=random.Random(7))
    workers = views(loads, residency, unhealthy)
    draws = 3000
    counts = {i: 0 for i in range(len(loads))}
    for _ in range(draws):
        decision = router.choose("m", workers, prefixes=("p",))
        assert decision.reason is RouteReason.RANDOM
        counts[TARGETS.index(decision.target)] += 1
    assert {i for i, n in counts.items() if n} == eligible
    for i in eligible:  # uniform: each within 15% of its expected share
        assert abs(counts[i] - draws / len(eligible)) < 0.15 * draws / len(eligible), counts
    assert len(router.affinity) == 0  # no prefix affinity is recorded either


@pytest.mark.parametrize("policy", ["affinity", "random"])
def test_an_adapter_stays_on_its_holder_only_under_affinity(policy: str) -> None:
    router = Router(policy=policy, rng=random.Random(3))  # type: ignore[arg-type]  # a str from the parametrize list
    workers = views([0, 0, 0], {1: Tier.DEVICE})
    targets = {router.choose("m", workers).target for _ in range(60)}
    assert targets == ({TARGETS[1]} if policy == "affinity" else set(TARGETS[:3]))


def test_random_policy_keeps_the_errors_of_an_empty_or_full_fleet() -> None:
    router = Router(max_load=2, policy="random")
    with pytest.raises(NoHealthyWorker):
        router.choose("m", views([0, 0], unhealthy=(0, 1)))
    with pytest.raises(CapacityExhausted):
        router.choose("m", views([2, 3]))


@pytest.mark.parametrize(
    ("residency", "expected", "reason"),
    [
        # both components on the device of worker 1; worker 0 holds one of them only
        ({0: {"a": Tier.DEVICE}, 1: {"a": Tier.DEVICE, "b": Tier.DEVICE}}, 1, RouteReason.DEVICE),
        # the farthest component decides: device + host is a host holder
        ({0: {"a": Tier.DEVICE, "b": Tier.HOST}, 2: {"b": Tier.DEVICE}}, 0, RouteReason.HOST),
    ],
)
def test_a_mix_goes_where_all_its_components_are(
    residency: dict[int, dict[str, Tier]], expected: int, reason: RouteReason
) -> None:
    workers = [WorkerView(t, True, 0, residency.get(i, {})) for i, t in enumerate(TARGETS[:3])]
    decision = Router().choose("mix:a=0.7,b=0.3", workers)
    assert decision == RouteDecision(TARGETS[expected], reason)
