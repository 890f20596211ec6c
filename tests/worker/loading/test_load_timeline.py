"""Where a cold request's wait goes (``load_timeline.py``): each request that finds its adapter
off the device gets one timeline, closed when it is admitted; its phases follow each other and add
up to the whole wait, with CPU time where something computes; a resident adapter or an operator's
load records none."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from lorastream.worker.loading.landing import FetchTimes
from lorastream.worker.loading.load_timeline import LoadTimeline
from lorastream.worker.metrics import COLD_LOAD_PHASES as PHASES
from tests.worker.conftest import EngineFactory, StoreStack, greedy_tokens


def _phase_counts(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    counts: dict[tuple[str, str], float] = {}
    for family in registry.collect():
        if family.name != "lorastream_worker_cold_load_phase_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith("_count"):
                counts[(sample.labels["phase"], sample.labels["clock"])] = sample.value
    return counts


def _sums(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    sums: dict[tuple[str, str], float] = {}
    for family in registry.collect():
        if family.name == "lorastream_worker_cold_load_phase_seconds":
            for sample in family.samples:
                if sample.name.endswith("_sum"):
                    sums[(sample.labels["phase"], sample.labels["clock"])] = sample.value
    return sums


def test_phases_of_a_timeline_follow_each_other_and_add_up_to_the_wait() -> None:
    # a request at -0.1, resolved at 0; its fetch 0.1-0.6 (0.05 landing, 0.1 checksums);
    # copy 0.7-0.8
    fetch = FetchTimes(wall_s=0.48, cpu_s=0.3, landing_s=0.05, landing_cpu_s=0.04,
                       checksum_s=0.1, checksum_cpu_s=0.09)
    timeline = LoadTimeline(requested=9.9, resolved=10.0, fetch_began=10.1, fetch_ended=10.6,
                            fetch=fetch, copy_submitted=10.7, copy_ended=10.8, copy_cpu_s=0.01,
                            admitted=10.85)
    phases = timeline.phases()
    assert list(phases) == [*PHASES, "total"]
    assert phases["stream"] == pytest.approx((0.35, 0.17))
    assert phases["checksum"] == pytest.approx((0.1, 0.09))
    assert sum(wall for name, (wall, _) in phases.items() if name != "total") == pytest.approx(
        phases["total"][0])
    assert "stream 350 (cpu 170)" in timeline.describe()


@pytest.mark.parametrize("fetch_process", [True, False], ids=["fetch-process", "in-process"])
def test_a_cold_request_records_each_phase_of_its_load_once(
    engine_factory: EngineFactory, store: StoreStack, fetch_process: bool
) -> None:
    engine = engine_factory(store=store.target, fetch_process=fetch_process)
    registry = engine.adapters.metrics.registry
    greedy_tokens(engine, "attn-r4", 0)  # cold: fetched, checked, landed, copied, admitted
    counts = _phase_counts(registry)
    for phase in PHASES:
        assert counts[(phase, "wall")] == 1, phase
    for phase in ("stream", "checksum", "landing", "slot_copy"):
        assert counts[(phase, "cpu")] == 1, phase
    sums = _sums(registry)
    assert sums[("checksum", "cpu")] > 0 and sums[("landing", "cpu")] > 0
    assert sums[("total", "wall")] >= sums[("stream", "wall")] + sums[("slot_copy", "wall")]

    greedy_tokens(engine, "attn-r4", 1)  # resident now: no load to time
    engine.adapters.load("mlp-r8", None, pin=False, timeout_s=30)  # an operator's load
    greedy_tokens(engine, "mlp-r8", 0)  # resident when the request came
    assert _phase_counts(registry)[("total", "wall")] == 1
