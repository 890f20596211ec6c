"""Fixtures for the benchmark tests: the tiny random Llama checkpoint as a worker ``--model``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.models import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # a long context, so a background stream outlasts the interference windows on a fast box
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model",
                                max_position_embeddings=4096)
