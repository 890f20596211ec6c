"""The router on plain views of workers: residency order, hash stability, load, health."""

from __future__ import annotations

import hashlib

import pytest

from lorastream.core.errors import CapacityExhausted
from lorastream.gateway.errors import NoHealthyWorker
from lorastream.gateway.routing import Router, RouteReason, Tier, WorkerView, hrw_score

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
