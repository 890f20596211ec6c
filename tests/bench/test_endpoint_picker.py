"""The port of llm-d-router's metrics extractor and scorers (``lorastream.bench.endpoint_picker``)
on exposition text written by hand: the rules the contract test relies on."""

from __future__ import annotations

import random

import pytest

from lorastream.bench.endpoint_picker import (
    EndpointView,
    extract,
    kv_cache_scores,
    lora_affinity,
    pick,
    queue_scores,
)

TWO_LORA_SERIES = """\
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="old",waiting_lora_adapters=""} 100.0
vllm:lora_requests_info{max_lora="4",running_lora_adapters=" a, b ,,",waiting_lora_adapters="c"} 200
vllm:lora_requests_info{max_lora="4",running_lora_adapters="tie",waiting_lora_adapters=""} 200
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting 3.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running 2.9
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="512"} 1.0
"""


def test_the_lora_series_with_the_largest_value_wins_and_names_are_split_and_trimmed() -> None:
    view = extract(TWO_LORA_SERIES)
    assert view == EndpointView(
        waiting_queue_size=3, running_requests_size=2, kv_cache_usage=0.25,
        active_models=frozenset({"a", "b"}), waiting_models=frozenset({"c"}),
        max_active_models=4, block_size=16, num_gpu_blocks=512,
    )


def test_a_missing_lora_family_leaves_the_previous_view() -> None:
    before = extract(TWO_LORA_SERIES)
    after = extract("# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 7\n", before)
    assert after.active_models == before.active_models and after.waiting_queue_size == 7


def view(active: set[str], waiting: set[str], max_lora: int = 2, queue: int = 0,
         kv: float = 0.0) -> EndpointView:
    return EndpointView(waiting_queue_size=queue, kv_cache_usage=kv,
                        active_models=frozenset(active), waiting_models=frozenset(waiting),
                        max_active_models=max_lora)


@pytest.mark.parametrize(("endpoint", "score"), [
    (view({"m"}, set()), 1.0),
    (view({"x"}, set()), 0.8),  # a free slot
    (view({"x"}, {"m"}), 0.6),  # full, m already waiting
    (view({"x", "y"}, set()), 0.0),  # full
])
def test_lora_affinity_scores_as_the_picker(endpoint: EndpointView, score: float) -> None:
    assert lora_affinity(endpoint, "m") == score


def test_queue_and_kv_scores_and_the_pick() -> None:
    views = [view({"m"}, set(), queue=4, kv=0.5), view(set(), set(), queue=0, kv=0.0),
             view({"x", "y"}, set(), queue=2)]
    assert queue_scores(views) == [0.0, 1.0, 0.5]
    assert queue_scores(views[:1]) == [1.0]
    assert kv_cache_scores(views) == [0.5, 1.0, 1.0]
    # 2 x affinity + queue + kv: 2.5, 3.6, 1.5
    assert pick(views, "m", random.Random(0)) == 1
    assert pick(views[::2], "m", random.Random(0)) == 0
