"""The admission cost model: hold new prefills only for loads cheaper than the step they save."""

from __future__ import annotations

import pytest

from lorastream.worker.loading.device_tier import AdmissionCostModel


def _fitted(fixed: float = 0.040, per_token: float = 0.0005) -> AdmissionCostModel:
    model = AdmissionCostModel(max_hold_s=0.05)
    for tokens in (1, 8, 32, 64, 128, 256, 16, 4, 512, 2):
        model.observe_step(tokens, fixed + per_token * tokens)
    return model


def test_the_step_cost_is_fitted_from_observed_steps() -> None:
    fixed, per_token = _fitted().step_cost()  # type: ignore[misc]  # fitted: not None after a fit
    assert fixed == pytest.approx(0.040, rel=1e-6) and per_token == pytest.approx(0.0005, rel=1e-6)


@pytest.mark.parametrize(
    ("etas", "hold"),
    [
        ([0.003], True),  # a copy about to land: cheaper than a 40 ms step
        ([0.300], False),  # a store fetch: admit now
        ([None], False),  # no load under way
        ([], False),
        ([0.300, 0.010], True),  # the nearest load decides
    ],
)
def test_new_prefills_are_held_only_for_loads_cheaper_than_a_step(
    etas: list[float | None], hold: bool
) -> None:
    assert _fitted().should_hold(etas, now=100.0) is hold


def test_without_enough_history_nothing_is_held() -> None:
    model = AdmissionCostModel()
    model.observe_step(10, 0.1)
    assert model.should_hold([0.001]) is False


def test_a_hold_never_outlasts_max_hold() -> None:
    model = _fitted()
    assert model.should_hold([0.001], now=10.0)
    assert model.should_hold([0.001], now=10.04)
    assert not model.should_hold([0.001], now=10.06)  # 60 ms > max_hold 50 ms: admit
    model.released()
    assert model.should_hold([0.001], now=11.0)  # a new hold starts afresh


@pytest.mark.parametrize(
    ("fetching", "elapsed", "expected"),
    [(True, 0.0, 1.0 + 0.01), (True, 0.5, 0.51), (False, 0.0, 0.01), (True, 5.0, 0.0)],
)
def test_eta_follows_the_observed_fetch_and_copy_rates(
    fetching: bool, elapsed: float, expected: float
) -> None:
    model = AdmissionCostModel()
    model.observe_fetch(1_000_000, 1.0)  # 1 MB/s from the store
    model.observe_copy(1_000_000, 0.01)  # 100 MB/s host -> slot
    assert model.eta(1_000_000, started=0.0, fetching=fetching, now=elapsed) == pytest.approx(
        expected
    )
