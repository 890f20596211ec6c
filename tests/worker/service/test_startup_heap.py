"""``worker serve`` freezes its startup heap, so that full garbage collections while serving
walk only what came later (a 200 ms pause of every stream on the default model otherwise)."""

from __future__ import annotations

import gc

from lorastream.worker.service.server import freeze_startup_heap
from tests.worker.conftest import EngineFactory


def _tracked(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects())


def test_the_startup_heap_is_frozen_and_later_objects_are_still_collected(
    engine_factory: EngineFactory,
) -> None:
    engine = engine_factory(start=False)
    assert _tracked(engine.model)
    try:
        assert freeze_startup_heap() > 0
        assert not _tracked(engine.model)  # a full collection no longer walks the model
        later: list[object] = []
        later.append(later)  # garbage in a cycle, made after the freeze
        assert _tracked(later)
        del later
        assert gc.collect() > 0
    finally:
        gc.unfreeze()
