"""deploy/grafana/lorastream.json: every series it queries exists, with the labels it uses, in the
registries the gateway, the workers and the store export; and every metric they export is charted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from lorastream.gateway.metrics import GatewayMetrics
from lorastream.gateway.routing import RouteDecision, RouteReason, Tier, WorkerView
from lorastream.store.sources import SourceRegistry
from lorastream.store.store import AdapterStore
from lorastream.worker.metrics import TierState, WorkerMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "lorastream.json"
TARGET_LABELS = {"le", "instance", "job"}  # added by histograms and by Prometheus' scrape
_SUFFIXES = ("", "_total", "_bucket", "_sum", "_count")
_NAME = re.compile(r"\blorastream_[a-z0-9_]+")
_SELECTOR = re.compile(r"\b(lorastream_[a-z0-9_]+)\{([^}]*)\}")
_BY = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


def gateway_registry() -> CollectorRegistry:
    """The gateway's registry with one series of every metric (labelled ones appear on use)."""
    metrics = GatewayMetrics()
    views = [WorkerView("w:1", True, 0, {"a": Tier.DEVICE})]
    metrics.watch_residency(lambda: views)
    metrics.routed("a", RouteDecision("w:1", RouteReason.DEVICE), views, base_model=False)
    metrics.first_token("a", 0.1)
    metrics.observe_tokens("a", 0.05, 1)
    metrics.finished("a", 1.0, 3)
    metrics.requests.labels("/v1/completions", "200").inc()
    metrics.worker_healthy.labels("w:1").set(1)
    metrics.worker_queue.labels("w:1").set(0)
    metrics.retries.labels("w:1").inc()
    return metrics.registry


def worker_registry() -> CollectorRegistry:
    metrics = WorkerMetrics()
    metrics.watch(lambda: TierState({"device": 1}, {"device": 10}, 0, 0, 0, 0,
                                    slot_bytes={"projections": 10, "experts": 20}))
    return metrics.registry


def store_registry(tmp_path: Path) -> CollectorRegistry:
    return AdapterStore(tmp_path / "store", 1 << 20, SourceRegistry([])).metrics.registry


@pytest.fixture
def exported(tmp_path: Path) -> dict[str, dict[str, set[str]]]:
    """service -> family name -> label names of its samples."""
    registries = {"gateway": gateway_registry(), "worker": worker_registry(),
                  "store": store_registry(tmp_path)}
    found: dict[str, dict[str, set[str]]] = {}
    for service, registry in registries.items():
        families = found[service] = {}
        for family in registry.collect():
            labels = families.setdefault(family.name, set())
            for sample in family.samples:
                labels |= set(sample.labels)
    return found


def queries() -> Iterator[tuple[str, str]]:
    """(panel title, PromQL) of every target of the dashboard."""
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


def family_of(name: str, families: dict[str, set[str]]) -> str | None:
    """The exported family a queried series name belongs to (``x_total`` -> ``x``)."""
    for suffix in _SUFFIXES:
        if name.endswith(suffix) and name[: len(name) - len(suffix)] in families:
            return name[: len(name) - len(suffix)]
    return None


def problems(exported: dict[str, dict[str, set[str]]]) -> list[str]:
    families = {name: labels for service in exported.values() for name, labels in service.items()}
    found: list[str] = []
    charted: set[str] = set()
    for title, expr in queries():
        names = _NAME.findall(expr)
        if not names:
            found.append(f"{title}: {expr!r} queries no lorastream series")
        known: set[str] = set(TARGET_LABELS)
        for name in names:
            family = family_of(name, families)
            if family is None:
                found.append(f"{title}: {name} is exported by no registry")
                continue
            charted.add(family)
            known |= families[family]
        for name, selector in _SELECTOR.findall(expr):
            family = family_of(name, families)
            for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", selector):
                if family is not None and label not in families[family] | TARGET_LABELS:
                    found.append(f"{title}: {name} has no label {label}")
        for group in _BY.findall(expr):
            for label in (part.strip() for part in group.split(",") if part.strip()):
                if label not in known:
                    found.append(f"{title}: no series of {expr!r} has the label {label}")
    # The vllm:* gauges are the worker's own figures again, under the names Kubernetes' endpoint
    # picker reads (docs/metrics.md): charted once, under lorastream's names.
    for name in sorted(n for n in set(families) - charted if not n.startswith("vllm:")):
        found.append(f"{name} is exported but no panel charts it")
    return found


def test_every_queried_series_and_label_is_exported_and_every_metric_is_charted(
    exported: dict[str, dict[str, set[str]]],
) -> None:
    assert problems(exported) == []


def test_the_dashboard_has_a_row_per_service_and_a_prometheus_datasource_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert rows == ["Gateway", "GPU workers", "Adapter store"]
    (variable,) = dashboard["templating"]["list"]
    assert (variable["type"], variable["query"]) == ("datasource", "prometheus")
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert [t["refId"] for t in panel["targets"]] == [
                chr(ord("A") + i) for i in range(len(panel["targets"]))]


BREAKAGES: list[tuple[str, Any]] = [
    ("misspelled-series", lambda e: e["worker"].pop("lorastream_worker_adapter_hits")),
    ("label-not-exported", lambda e: e["gateway"]["lorastream_gateway_adapter_tier_requests"]
     .discard("tier")),
    ("metric-not-charted", lambda e: e["store"].update(lorastream_store_new_gauge=set())),
]


@pytest.mark.parametrize("breakage", [b for _, b in BREAKAGES], ids=[n for n, _ in BREAKAGES])
def test_a_dashboard_out_of_step_with_the_code_is_caught(
    exported: dict[str, dict[str, set[str]]], breakage: Any
) -> None:
    breakage(exported)
    assert problems(exported)


def test_docs_metrics_lists_every_exported_metric(
    exported: dict[str, dict[str, set[str]]],
) -> None:
    documented = set(re.findall(r"\| `((?:lorastream_|vllm:)[a-z0-9_]+)` \|",
                                (ROOT / "docs" / "metrics.md").read_text()))
    for families in exported.values():
        for name in families:
            assert {name, f"{name}_total"} & documented, f"docs/metrics.md: no row for {name}"
