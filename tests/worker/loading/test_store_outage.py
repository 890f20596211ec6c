"""Issue 25 item 4, the worker's side: names resolve through the watched catalogue.

A resident adapter costs no store call; with the real store server stopped, resident adapters
keep serving and cold ones fail with a clear error; the watch reconnects when the store is back.
After a push is acknowledged, no request for the name runs on the old weights, under load; and
``name@<id prefix>`` serves an older version. Real store server, tiny model, PEFT references.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from lorastream.core.errors import SourceUnavailable
from lorastream.core.store_client import StoreClient
from lorastream.worker.engine.engine import Engine
from lorastream.worker.loading.names import CatalogueState
from tests.worker.conftest import PROMPTS, EngineFactory, StoreStack, greedy_tokens


def _live(engine: Engine) -> None:
    catalogue = engine.adapters.catalogue
    assert catalogue is not None and catalogue.wait_state(CatalogueState.LIVE, 10)
    catalogue.backoff_max_s = 0.2  # reconnect quickly once the store is back


def _count_describes(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every DescribeAdapter the worker sends (the real call still goes out)."""
    fetcher = engine.adapters.fetcher
    calls: list[str] = []
    real = fetcher.describe

    def counted(name: str):
        calls.append(name)
        return real(name)

    monkeypatch.setattr(fetcher, "describe", counted)
    return calls


def test_resident_adapters_serve_through_a_store_outage_and_cold_ones_fail_clearly(
    engine_factory: EngineFactory, store: StoreStack,
    reference: dict[tuple[str, int], list[int]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = engine_factory(store=store.target)
    _live(engine)
    describes = _count_describes(engine, monkeypatch)
    assert greedy_tokens(engine, "attn-r4", 0) == reference[("attn-r4", 0)]  # cold: described
    assert describes == [f"attn-r4@{engine.adapters.resolve('attn-r4')}"]
    for i in range(len(PROMPTS)):  # resident: no store call on the request path
        assert greedy_tokens(engine, "attn-r4", i) == reference[("attn-r4", i)]
    assert len(describes) == 1

    store.server.stop(None).wait()
    catalogue = engine.adapters.catalogue
    assert catalogue is not None and catalogue.wait_state(CatalogueState.DOWN, 5)
    for i in range(len(PROMPTS)):
        assert greedy_tokens(engine, "attn-r4", i) == reference[("attn-r4", i)]
    with pytest.raises(SourceUnavailable, match=r"mlp-r8 is not held on this worker .* "
                       r"unreachable since .* keep serving"):
        greedy_tokens(engine, "mlp-r8", 0)

    store.restart()
    assert catalogue.wait_state(CatalogueState.LIVE, 5), "the watch did not reconnect"
    assert greedy_tokens(engine, "mlp-r8", 0) == reference[("mlp-r8", 0)]


def test_after_a_push_is_acknowledged_no_request_runs_on_the_old_weights(
    engine_factory: EngineFactory, store: StoreStack, tiny_adapters: dict[str, Path],
    reference: dict[tuple[str, int], list[int]],
) -> None:
    old, new = reference[("attn-r4", 0)], reference[("mlp-r8", 0)]
    assert old != new
    with StoreClient(store.target) as client:
        v1 = client.push(tiny_adapters["attn-r4"], "policy")
        engine = engine_factory(store=store.target)
        _live(engine)
        assert greedy_tokens(engine, "policy", 0) == old
        runs: list[tuple[float, list[int]]] = []  # (start, tokens) of every request under load
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                started = time.monotonic()
                runs.append((started, greedy_tokens(engine, "policy", 0)))

        threads = [threading.Thread(target=load) for _ in range(3)]
        for thread in threads:
            thread.start()
        time.sleep(0.5)
        catalogue = engine.adapters.catalogue
        assert catalogue is not None
        catalogue.apply_delay_s = 0.3  # a slow worker: the push must wait for it
        v2 = client.push(tiny_adapters["mlp-r8"], "policy")
        acknowledged = time.monotonic()
        assert catalogue.lookup("policy").adapter_id == v2.adapter_id
        assert greedy_tokens(engine, "policy", 0) == new
        time.sleep(0.5)
        stop.set()
        for thread in threads:
            thread.join(30)
    before = [tokens for started, tokens in runs if started < acknowledged]
    after = [tokens for started, tokens in runs if started > acknowledged]
    assert before and after
    assert all(tokens in (old, new) for tokens in before)
    assert all(tokens == new for tokens in after), "a request after the push ran on v1"
    # The old version stays requestable by its content id.
    assert greedy_tokens(engine, f"policy@{v1.adapter_id[:10]}", 0) == old
    assert greedy_tokens(engine, "policy", 0) == new
