"""The per-step staging arenas: values land where the views point, arenas alternate and grow."""

from __future__ import annotations

import torch

from lorastream.worker.device.device import Device
from lorastream.worker.device.step_arena import StepStaging


def test_staged_values_are_visible_through_the_views_and_arenas_alternate() -> None:
    staging = StepStaging(Device("cpu"), capacity=16)
    first = staging.next(need=8)
    ids = first.longs([5, 9, 33])
    table = first.longs_2d([[7, 2], [4, 0]], width=2)
    scales = first.floats([0.5, 2.0])
    first.flush()
    assert ids.tolist() == [5, 9, 33] and table.tolist() == [[7, 2], [4, 0]]
    assert scales.tolist() == [0.5, 2.0]
    second = staging.next(need=8)
    assert second is not first
    second.longs([1, 1, 1])
    assert ids.tolist() == [5, 9, 33]  # the previous step's views are untouched
    assert staging.next(need=8) is first  # and the first arena comes back


def test_an_arena_grows_when_a_step_needs_more_than_its_capacity() -> None:
    staging = StepStaging(Device("cpu"), capacity=4)
    arena = staging.next(need=100)
    values = list(range(100))
    assert arena.longs(values).tolist() == values


def test_views_share_memory_with_the_arena_on_the_cpu() -> None:
    arena = StepStaging(Device("cpu"), capacity=8).next(need=4)
    view = arena.longs([1, 2])
    view.add_(10)
    assert view.tolist() == [11, 12] and view.dtype == torch.int64
