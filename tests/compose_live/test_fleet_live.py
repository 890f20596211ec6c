"""``lorastream bench fleet``, small, for real: three worker containers behind the gateway, both
routing policies over one zipf trace, one worker killed under traffic. Run by
``make test-compose`` (LORASTREAM_TEST_COMPOSE=1); elsewhere it skips with the reason."""

from __future__ import annotations

import pytest

from lorastream.bench.compose import ComposeProject
from lorastream.bench.fleet import FleetConfig, run_fleet_bench
from tests.compose_live.stack import engine_problem

pytestmark = [pytest.mark.compose, pytest.mark.timeout(2400)]

_PROBLEM = engine_problem()
if _PROBLEM:
    pytestmark.append(pytest.mark.skip(reason=_PROBLEM))


def test_a_small_fleet_bench_measures_both_policies_and_a_killed_worker() -> None:
    config = FleetConfig(adapters=20, requests=60, kill_requests=60, kill_after_s=3.0)
    result = run_fleet_bench(config)
    assert set(result["runs"]) == {"affinity", "random"}
    for policy, run in result["runs"].items():
        assert run["ok"] == run["requests"] == 60, run["errors"]
        # every request reached a worker, which counted it once (no failover in these runs)
        assert run["requests_counted"] == 60, run
        assert 0.0 <= run["device_share"] <= run["held_share"] <= 1.0, run
        # the first request for each adapter was a miss on a cold fleet
        assert run["store_fetches"] >= run["distinct_adapters"], run
        assert run["output_tokens"] == 60 * config.max_tokens, run
        reasons = set(run["routing_decisions"])
        assert reasons == {"random"} if policy == "random" else "random" not in reasons, run
    failure = result["failure"]
    reserved = failure["reserved"]
    assert failure["held_per_worker"][failure["worker"]] == reserved["held"] > 0
    assert reserved["reserved"] <= reserved["requested_after_kill"] <= reserved["held"]
    assert failure["container_back_healthy_s"] > 0
    # requests after the kill fail over or fail cleanly; most succeed
    assert failure["traffic"]["ok"] >= failure["traffic"]["requests"] // 2, failure
    # down -v left nothing of the project behind
    project = ComposeProject(result["stack"]["project"], [])
    assert project.leftovers() == {"containers": [], "networks": [], "volumes": []}
