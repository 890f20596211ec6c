"""The parts of ``lorastream bench pool``: the picker's routing over views built from scraped
text, the random baseline, the share and latency figures, the worker flags, and the page's
section from a small result."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from benchpage.report import render_page
from benchpage.report_pool import pool_goals, pool_section
from lorastream.bench.endpoint_picker import EndpointView
from lorastream.bench.pool import (
    ChildScraper,
    PickerRouter,
    PoolConfig,
    Scraper,
    comparison,
    counted_per_worker,
    random_targets,
    scrape_latency,
)


def metrics(running: str, waiting: str = "", queue: int = 0, kv: float = 0.0,
            max_lora: int = 2, stamp: float = 100.0) -> str:
    """A worker's vLLM-named gauges as the picker scrapes them."""
    return (
        "# TYPE vllm:lora_requests_info gauge\n"
        f'vllm:lora_requests_info{{max_lora="{max_lora}",running_lora_adapters="{running}",'
        f'waiting_lora_adapters="{waiting}"}} {stamp}\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting {queue}\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f"vllm:kv_cache_usage_perc {kv}\n"
    )


def router(*texts: str) -> PickerRouter:
    picker = PickerRouter(len(texts), random.Random(0))
    for pod, text in enumerate(texts):
        picker.update(pod, text)
    return picker


@pytest.mark.parametrize(("model", "pod"), [
    ("a", 0),  # running on pod 0 (1.0 x 2) beats a free slot on pod 2 (0.8 x 2)
    ("b", 1),
    ("cold", 2),  # only pod 2 has a free slot
    ("c", 2),  # a free slot (0.8) beats waiting on pod 0 (0.6)
])
def test_the_picker_routes_by_residency_then_free_slots_then_waiting(model: str, pod: int) -> None:
    picker = router(metrics("a,x", waiting="c"), metrics("b,y"), metrics("z"))
    assert picker.choose(model) == pod


def test_with_every_slot_taken_the_pod_where_the_adapter_waits_wins() -> None:
    picker = router(metrics("a,x", waiting="c"), metrics("b,y"), metrics("z,w"))
    assert picker.choose("c") == 0


def test_one_queued_request_outweighs_holding_the_adapter_over_a_free_slot() -> None:
    # pod 1: 2 x 1.0 + queue 0 (the longest) + kv 1 = 3.0; pod 2: 2 x 0.8 + 1 + 1 = 3.6
    picker = router(metrics("a,x"), metrics("b,y", queue=1), metrics("z"))
    assert picker.choose("b") == 2


def test_with_equal_affinity_the_shorter_queue_and_emptier_kv_cache_win() -> None:
    assert router(metrics("x,y", queue=3), metrics("x,z", queue=1)).choose("cold") == 1
    assert router(metrics("x,y", kv=0.9), metrics("x,z", kv=0.1)).choose("cold") == 1


def test_a_scrape_missing_the_lora_family_keeps_the_pods_last_residency() -> None:
    picker = router(metrics("a,x"), metrics("y,z"))
    picker.update(0, "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n")
    assert picker.choose("a") == 0


def test_random_routing_is_the_same_for_a_seed_and_spreads_over_every_pod() -> None:
    targets = random_targets(300, 3, seed=7)
    assert targets == random_targets(300, 3, seed=7) != random_targets(300, 3, seed=8)
    assert set(targets) == {0, 1, 2}


def test_requests_per_worker_are_its_device_hits_and_misses_between_the_counts() -> None:
    before = {"w0": {"hits:device": 2, "misses:device": 1, "hits:host": 1}, "w1": {}}
    after = {"w0": {"hits:device": 5, "misses:device": 3, "hits:host": 4},
             "w1": {"hits:device": 1, "misses:device": 4, "misses:host": 4}}
    assert counted_per_worker(before, after) == [5, 5]


@pytest.mark.parametrize(("held", "device", "expected"), [
    ({"picker": 0.7, "picker-device": 0.6, "random": 0.3, "gateway": 0.72},
     {"picker": 0.5, "random": 0.2, "gateway": 0.4}, (2.0, 12.0, 40.0, -10.0, 30.0)),
    ({"picker": 0.8, "random": 0.35, "gateway": 0.7}, {},
     (-10.0, None, 45.0, None, None)),
    ({"picker": None, "random": 0.3, "gateway": 0.7}, {},
     (None, None, None, None, None)),
])
def test_the_comparison_is_in_points_of_held_and_of_device_share(
    held: dict[str, float | None], device: dict[str, float], expected: tuple[float | None, ...]
) -> None:
    runs = {p: {"held_share": share, "device_share": device.get(p)} for p, share in held.items()}
    assert tuple(comparison(runs).values()) == expected
    assert list(comparison(runs)) == [
        "gateway_minus_picker_points", "gateway_minus_picker_device_points",
        "picker_minus_random_points",
        "device_gateway_minus_picker_points", "device_picker_minus_random_points"]


def test_scrape_latency_reports_the_scrapes_that_saw_requests_waiting_apart() -> None:
    samples = [(0.004, False)] * 10 + [(0.020, True)] * 9 + [(0.090, True)]
    figures = scrape_latency(samples)
    assert figures["scrapes"] == 20 and figures["saturated_scrapes"] == 10
    assert figures["saturated_ms"]["p50"] == 20.0
    assert figures["saturated_ms"]["p99"] == figures["saturated_max_ms"] == 90.0
    assert figures["all_ms"]["p50"] == 20.0 and figures["all_ms"]["p99"] == 90.0
    assert scrape_latency([])["saturated_ms"]["p99"] is None


@pytest.fixture
def metrics_server() -> Iterator[str]:
    """A /metrics endpoint on loopback answering a saturated worker's gauges."""
    body = metrics("a", queue=4).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()


def test_the_scraper_feeds_every_scrape_to_the_picker_and_times_it(metrics_server: str) -> None:
    picker = PickerRouter(1, random.Random(0))
    seen = threading.Event()

    def update(text: str) -> EndpointView:
        view = picker.update(0, text)
        seen.set()
        return view

    with Scraper(metrics_server, 0.001, update) as scraper:
        assert seen.wait(60)
    assert scraper.errors == 0 and scraper.samples
    assert all(waiting for _, waiting in scraper.samples)
    assert picker.views[0].active_models == {"a"} and picker.views[0].waiting_queue_size == 4


def test_the_scraper_in_its_own_process_returns_its_timed_scrapes(metrics_server: str) -> None:
    with ChildScraper(metrics_server, 0.001) as scraper:
        pass  # it scrapes at least once before it stops
    assert scraper.samples and scraper.errors == 0
    assert all(waiting for _, waiting in scraper.samples)


def test_every_pod_is_started_with_the_configs_slots_and_host_cache() -> None:
    args = PoolConfig(slots=3, host_cache_bytes=1 << 20).pod_settings().worker_args(
        5000, 5001, "127.0.0.1:1")
    flags = dict(zip(args[2::2], args[3::2], strict=True))
    assert flags["--max-loras"] == "3" and flags["--host-cache-bytes"] == str(1 << 20)
    assert flags["--metrics-port"] == "5001" and flags["--store"] == "127.0.0.1:1"


RESULT = {
    "command": "lorastream bench pool --requests 10",
    "config": {"workers": 3, "slots": 2, "adapters": 12, "requests": 10, "zipf_s": 1.1,
               "host_cache_bytes": 16 << 20},
    "runs": {
        "picker": {"held_share": 0.6, "device_share": 0.5, "store_fetches": 4,
                   "requests_per_worker": [3, 3, 4], "output_tok_s": 41.5,
                   "ttft_ms": {"p50": 210.0}, "ok": 10, "requests": 10,
                   "metrics": {"scrapes": 90, "all_ms": {"p50": 5.0, "p99": 70.0}}},
        "random": {"held_share": 0.2, "ttft_ms": {"p50": 400.0}, "ok": 10, "requests": 10},
        "gateway": {"held_share": 0.63, "ttft_ms": {"p50": 250.0}, "ok": 10, "requests": 10},
    },
    "gateway_minus_picker_points": 3.0,
    "picker_minus_random_points": 40.0,
    "metrics_saturated": {"streams": 24, "batch": 8, "saturated_scrapes": 40,
                          "saturated_ms": {"p50": 6.0, "p99": 61.5}, "saturated_max_ms": 70.1,
                          "from_benchmark_thread": {"saturated_scrapes": 38,
                                                    "saturated_ms": {"p50": 9.0, "p99": 95.0},
                                                    "saturated_max_ms": 99.5}},
    "metrics_p99_ms_saturated": 61.5,
    "load_average_at_start": [4.5, 3.0, 2.0],
    "goal_picker_near_gateway": "gateway_minus_picker_points <= 5",
    "goal_picker_over_random": "picker_minus_random_points >= 20",
    "goal_metrics_p99": "metrics_p99_ms_saturated <= 50",
}


def test_the_goal_rows_give_points_and_milliseconds_with_their_verdicts() -> None:
    assert pool_goals(RESULT) == [
        ["pool: held share, lorastream gateway minus endpoint picker", "3.0 points",
         "≤ 5 points", "met"],
        ["pool: held share, endpoint picker minus random", "40.0 points", "≥ 20 points", "met"],
        ["pool: worker /metrics p99 while saturated", "61.5 ms", "≤ 50 ms", "**not met**"],
    ]


def test_the_section_shows_each_routings_figures_from_the_result() -> None:
    section = pool_section(RESULT, {})
    picker_row = next(line for line in section.splitlines() if line.startswith("| endpoint"))
    assert "60.0%" in picker_row and "3 / 3 / 4" in picker_row and "210.0" in picker_row
    assert "| random | 20.0%" in section and "| lorastream gateway | 63.0%" in section
    assert "gateway minus endpoint picker (held): 3.0 points" in section
    assert "| 40 | 6.0 | 61.5 | 70.1 |" in section  # the saturated pod's scrapes
    assert "| 38 | 9.0 | 95.0 | 99.5 |" in section  # the same from the benchmark's thread
    assert "a 16 MiB host cache" in section
    assert "4.50, 3.00, 2.00" in section and "None" not in section


def test_the_page_has_the_pool_section_or_says_how_to_produce_it() -> None:
    page = render_page({"pool": RESULT}, {})
    assert "(pool)" in page and "lorastream bench pool --requests 10" in page
    assert "Not run: no `pool.json`" in render_page({}, {})
