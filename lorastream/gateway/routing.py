"""Which worker serves a request: residency first, bounded by load, then rendezvous hashing.

Plain Python over plain views of the workers; the worker pool builds the views from its polls.

Semantics (for a request for adapter ``m``, over the healthy workers with room)::

    least = min(load of every candidate)
    mean = sum(load of every candidate) / number of candidates
    bound = least + max(spill_threshold, spill_fraction * mean)
    for tier in (DEVICE, HOST):                     # HOST includes "loading"
        holders = candidates holding m at that tier
        best = min(holders, key=(load, -hrw(m, w)))
        if best.load <= bound: return best, reason=tier
    top = argmax over candidates of hrw(m, w)       # consistent: m keeps landing on top
    if top.load <= bound: return top, reason=HASH
    return min(candidates, key=(load, -hrw(m, w))), reason=LEAST_LOADED
    # ... but before returning any of these (the base model's least loaded one included):
    last = affinity[m, longest known prefix of the prompt]   # who last served it for m
    if last is a candidate holding m (any tier for the base model) and last.load <= bound:
        return last, reason=PREFIX (DEVICE/HOST/... when it is the worker chosen anyway)

The base model needs no residency: it goes to the least loaded worker (ties broken by hash). A
weighted mix (``mix:a=0.7,b=0.3``) is as close to serving on a worker as its farthest component
(the lowest of their tiers there); its hash and affinity are its own spelling's.

Policy ``random`` (``--routing random``, a baseline to measure the rules above against, e.g. by
``lorastream bench fleet``): residency, hashing, load bounds and prefix affinity are ignored::

    return uniform choice over candidates, reason=RANDOM   # healthy, under max_load

Prefix affinity (``lorastream.gateway.prefix_affinity``): the worker that served a prompt prefix
of ``m`` last (a chat's system prompt and earlier turns) holds its KV blocks in its prefix cache,
so the next turn goes there while it is within the bound: a bounded table, least recently used
entries dropped, keyed by (model, chained hashes of the prompt's 64-character or 16-token chunks;
the longest known one decides). Load awareness is unchanged: past the bound, the rules below apply.

So no worker's queue grows past ``bound`` (+1, the request itself) for affinity's sake: the slack
a preferred worker gets over the least loaded one is ``spill_threshold`` requests, or a fixed
fraction of the mean queue once the workers are busy. A worker that comes back empty is the least
loaded one: every request whose holders are past the bound goes to it, and each adapter it receives
counts as loading there (the pool's routing hint), so it holds that adapter from its next request
on and competes for it on load.

Example: workers A (m on device, load 3), B (m in host memory, load 0), C (load 0),
spill_threshold 2, spill_fraction 0.25: mean 1, bound 0 + max(2, 0.25) = 2. A is past it, so B,
holding m in host memory at load 0, wins with reason HOST. With A at load 2 A would win (DEVICE).
Restart: A and B hold every adapter at load 12 each, C is back with nothing at load 0: mean 8,
bound 0 + max(2, 2) = 2, so C takes every request (as m's hash home, else as the least loaded)
until A and B are within 2 of it.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import Literal

from lorastream.core.adapter_mix import parse_mix_model
from lorastream.core.errors import CapacityExhausted
from lorastream.gateway.errors import NoHealthyWorker
from lorastream.gateway.prefix_affinity import PrefixAffinity


class Tier(IntEnum):
    """How close an adapter is to serving on one worker; higher is closer."""

    ABSENT = 0  # not on the worker, or only known by name ("remote")
    HOST = 1  # in host memory, or being fetched into it ("loading")
    DEVICE = 2  # in a device slot


TIER_OF_RESIDENCY: dict[str, Tier] = {
    "remote": Tier.ABSENT,
    "loading": Tier.HOST,
    "host": Tier.HOST,
    "device": Tier.DEVICE,
}


class RouteReason(StrEnum):
    """Why a worker was chosen (the label of the routing-decision counter)."""

    PREFIX = "prefix"
    DEVICE = "device"
    HOST = "host"
    HASH = "hash"
    LEAST_LOADED = "least-loaded"
    RANDOM = "random"  # policy "random" only


RoutingPolicy = Literal["affinity", "random"]


@dataclass(frozen=True)
class WorkerView:
    """What the router knows about one worker."""

    target: str
    healthy: bool
    load: int  # queue depth: waiting + running requests
    residency: Mapping[str, Tier] = field(default_factory=dict)  # adapter name -> tier

    def tier(self, model: str) -> Tier:
        """How close ``model`` is to serving here; a mix: its farthest component's tier."""
        mix = parse_mix_model(model)
        if mix is not None:
            return min(self.residency.get(name, Tier.ABSENT) for name, _ in mix)
        return self.residency.get(model, Tier.ABSENT)


@dataclass(frozen=True)
class RouteDecision:
    target: str
    reason: RouteReason


def hrw_score(model: str, target: str) -> int:
    """Rendezvous (highest random weight) score of ``target`` for ``model``; stable across runs."""
    digest = hashlib.blake2b(f"{model}\0{target}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class Router:
    """Chooses a worker for each request (``Semantics`` above; ``max_load``: the queue depth at
    which a worker takes no more requests, None for no limit). Its one state is the bounded
    prefix-affinity table (``prefix_table``: entries, 0 turns affinity off). ``policy``
    "random" picks uniformly among the candidates with ``rng`` (tests pass a seeded one)."""

    def __init__(
        self, spill_threshold: int = 2, max_load: int | None = None, spill_fraction: float = 0.25,
        prefix_table: int = 32768, policy: RoutingPolicy = "affinity",
        rng: random.Random | None = None,
    ) -> None:
        self.spill_threshold = spill_threshold
        self.spill_fraction = spill_fraction
        self.max_load = max_load
        self.affinity = PrefixAffinity(prefix_table)
        self.policy = policy
        self.rng = rng or random.Random()

    def choose(
        self,
        model: str,
        workers: Sequence[WorkerView],
        *,
        base_model: bool = False,
        exclude: Collection[str] = (),
        prefixes: Sequence[str] = (),
    ) -> RouteDecision:
        """The worker for one request for ``model`` (``prefixes``: ``prefix_keys`` of its
        prompt, remembered with the choice).

        Raises NoHealthyWorker when no healthy worker is left after ``exclude``, and
        CapacityExhausted when every healthy one is at ``max_load``.
        """
        healthy = [w for w in workers if w.healthy and w.target not in exclude]
        if not healthy:
            raise NoHealthyWorker(
                f"no healthy worker can serve {model!r} "
                f"({len(workers)} configured, {len(exclude)} just failed); retry shortly"
            )
        candidates = [w for w in healthy if self.max_load is None or w.load < self.max_load]
        if not candidates:
            raise CapacityExhausted(
                f"all {len(healthy)} healthy workers have {self.max_load} or more requests "
                "queued; retry later"
            )
        if self.policy == "random":
            return RouteDecision(self.rng.choice(candidates).target, RouteReason.RANDOM)
        # Highest hash first: the order every tie is broken by.
        ordered = sorted(candidates, key=lambda w: hrw_score(model, w.target), reverse=True)
        mean = sum(w.load for w in ordered) / len(ordered)
        bound = self.bound(min(w.load for w in ordered), mean)
        decision = self._by_residency(model, ordered, bound, base_model)
        # reason PREFIX only where affinity changed the choice
        decision = self._by_prefix(model, ordered, bound, base_model, prefixes, decision)
        self.affinity.served(model, prefixes, decision.target)
        return decision

    def _by_prefix(
        self, model: str, ordered: Sequence[WorkerView], bound: float, base_model: bool,
        prefixes: Sequence[str], otherwise: RouteDecision,
    ) -> RouteDecision:
        """The worker that last served the longest of ``prefixes`` of ``model`` it knows, if that
        worker may take the request, else ``otherwise`` (also when that is the same worker)."""
        last = self.affinity.lookup(model, prefixes)
        if last is None or last == otherwise.target:
            return otherwise
        for w in ordered:
            if w.target == last and w.load <= bound and (base_model or w.tier(model) > Tier.ABSENT):
                return RouteDecision(w.target, RouteReason.PREFIX)
        return otherwise

    def _by_residency(
        self, model: str, ordered: Sequence[WorkerView], bound: float, base_model: bool
    ) -> RouteDecision:
        if base_model:
            return RouteDecision(_least_loaded(ordered).target, RouteReason.LEAST_LOADED)
        for tier, reason in ((Tier.DEVICE, RouteReason.DEVICE), (Tier.HOST, RouteReason.HOST)):
            holders = [w for w in ordered if w.tier(model) == tier]
            if holders:
                best = _least_loaded(holders)
                if best.load <= bound:
                    return RouteDecision(best.target, reason)
        if ordered[0].load <= bound:
            return RouteDecision(ordered[0].target, RouteReason.HASH)
        return RouteDecision(_least_loaded(ordered).target, RouteReason.LEAST_LOADED)

    def bound(self, least: int, mean: float) -> float:
        """The deepest queue a preferred worker may have and still be chosen."""
        return least + max(self.spill_threshold, self.spill_fraction * mean)


def _least_loaded(ordered: Sequence[WorkerView]) -> WorkerView:
    """The least loaded of ``ordered``; on equal load, the earliest (the highest hash)."""
    return min(ordered, key=lambda w: w.load)  # min keeps the first of equal keys
