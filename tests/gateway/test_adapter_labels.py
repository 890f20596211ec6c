"""AdapterLabels: at most N models keep a metric label of their own, the busiest by a bounded
Space-Saving count; the rest are ``other``."""

from __future__ import annotations

import random

import pytest

from lorastream.gateway.adapter_labels import OTHER, AdapterLabels


def zipf_stream(names: int, length: int, seed: int, skew: float = 1.2) -> list[str]:
    """``length`` requests over ``names`` models, model i drawn with weight 1 / (i + 1)^skew."""
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** skew for i in range(names)]
    return rng.choices([f"adapter-{i}" for i in range(names)], weights, k=length)


@pytest.mark.parametrize("n", [1, 5, 20])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_busiest_models_of_a_zipf_stream_get_the_labels_with_bounded_counters(
    n: int, seed: int
) -> None:
    labels = AdapterLabels(n)
    stream = zipf_stream(names=2000, length=20_000, seed=seed)
    for model in stream:
        labels.observe(model)
        assert len(labels._counts) <= labels.capacity  # bounded memory, whatever the names
    assert len(labels.labelled) == n
    busiest = {f"adapter-{i}" for i in range(n)}  # the most likely n
    assert len(labels.labelled & busiest) >= n - max(1, n // 5), labels.labelled
    for model in {*stream}:
        assert labels.label(model) == (model if model in labels.labelled else OTHER)


def test_no_labels_puts_every_model_under_other() -> None:
    labels = AdapterLabels(0)
    assert [labels.observe(m) for m in ("a", "b", "a")] == [OTHER] * 3
    assert labels.labelled == frozenset()


def test_two_models_of_equal_traffic_do_not_swap_the_one_label() -> None:
    dropped: list[str] = []
    labels = AdapterLabels(1, on_drop=dropped.append)
    for _ in range(5000):
        labels.observe("a")
        labels.observe("b")
    assert labels.labelled == {"a"} and dropped == []


@pytest.mark.parametrize(
    ("stream", "labelled", "dropped"),
    [
        (["a", "a", "b"], {"a"}, []),
        (["a", "b", "b"], {"b"}, ["a"]),  # b: 2 > 5/4 * 1
        (["a", "a", "a", "a", "b", "b", "b", "b", "b"], {"a"}, []),  # 5 is not > 5/4 * 4
        (["a", "a", "a", "a", "b", "b", "b", "b", "b", "b"], {"b"}, ["a"]),  # 6 > 5
    ],
)
def test_a_newcomer_takes_the_label_once_it_is_a_quarter_busier(
    stream: list[str], labelled: set[str], dropped: list[str]
) -> None:
    seen: list[str] = []
    labels = AdapterLabels(1, on_drop=seen.append)
    for model in stream:
        labels.observe(model)
    assert labels.labelled == labelled and seen == dropped


def test_a_model_that_went_quiet_gives_its_label_to_one_that_got_busy() -> None:
    dropped: list[str] = []
    labels = AdapterLabels(1, on_drop=dropped.append)
    for _ in range(50 * labels.halve_every):  # "old" was busy for a long time
        labels.observe("old")
    for _ in range(3 * labels.halve_every):  # then only "new" is asked for
        labels.observe("new")
    assert labels.labelled == {"new"} and dropped == ["old"]


def test_a_negative_number_of_labels_is_refused() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        AdapterLabels(-1)
