"""Issue 28, finding 1: the worker's LoadAdapter/UnloadAdapter need the operate token, and the
worker reads the store with its read token. Real store and worker over gRPC on loopback.

Before the fix anyone reaching the worker's port could ``LoadAdapter(name="good",
local_path=<another adapter>)``: from then on every request for ``good`` ran with the other
adapter's weights, whatever tokens the gateway and the store had.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from lorastream.core import errors
from lorastream.core.generation import PromptInput, SamplingParams
from lorastream.core.store_client import StoreClient
from lorastream.core.worker_client import WorkerClient
from lorastream.store.config import StoreSettings
from lorastream.store.server import create_server as create_store
from lorastream.worker.service.bootstrap import build_engine
from lorastream.worker.service.config import WorkerSettings
from lorastream.worker.service.server import create_server as create_worker
from tests.worker.conftest import NEW_TOKENS, PROMPTS

STORE_OPERATE, STORE_READ, WORKER_OPERATE = "store-op-1", "store-read-2", "worker-op-3"


@dataclass
class Secured:
    store: str
    worker: str


@pytest.fixture
def secured(
    tiny_model: Path, tiny_adapters: dict[str, Path], tmp_path: Path
) -> Iterator[Secured]:
    """A store and a worker with tokens; ``good`` is the attn-r4 adapter in the store."""
    store_server, store_port, _ = create_store(StoreSettings(
        port=0, cache_dir=tmp_path / "store", token=STORE_OPERATE, read_token=STORE_READ,
        allowed_local_roots=[tiny_adapters["attn-r4"].parent],
    ))
    store_server.start()
    store = f"127.0.0.1:{store_port}"
    with StoreClient(store, STORE_OPERATE) as operator:
        for _ in operator.preload(str(tiny_adapters["attn-r4"]), "good"):
            pass
    settings = WorkerSettings(
        model=str(tiny_model), served_model_name="tiny", port=0, store=store, max_loras=2,
        kv_cache_bytes=8 << 20, model_cache_dir=tmp_path / "models", token=WORKER_OPERATE,
        store_token=STORE_READ,
    )
    server, port, engine = create_worker(settings, build_engine(settings, checkpoint=tiny_model))
    server.start()
    yield Secured(store, f"127.0.0.1:{port}")
    server.stop(None).wait()
    engine.stop()
    store_server.stop(None).wait()


def _greedy(worker: str, model: str) -> list[int]:
    params = SamplingParams(max_tokens=NEW_TOKENS)
    with WorkerClient(worker) as client:
        events = client.generate(model, PromptInput(token_ids=tuple(PROMPTS[0])), params)
        return [token for event in events for token in event.token_ids]


@pytest.mark.parametrize("token", [None, "wrong", STORE_READ], ids=["anonymous", "wrong", "read"])
def test_loading_another_adapter_under_a_served_name_is_refused(
    secured: Secured, tiny_adapters: dict[str, Path],
    reference: dict[tuple[str, int], list[int]], token: str | None,
) -> None:
    with WorkerClient(secured.worker, token=token) as attacker:
        with pytest.raises(errors.Unauthenticated):
            attacker.load_adapter("good", local_path=str(tiny_adapters["all-r16-rslora"]))
        with pytest.raises(errors.Unauthenticated):
            attacker.unload_adapter("good")
    # `good` still answers with its own weights, fetched from the store with the read token
    assert _greedy(secured.worker, "good") == reference[("attn-r4", 0)]


def test_the_operate_token_loads_and_unloads(secured: Secured) -> None:
    with WorkerClient(secured.worker, token=WORKER_OPERATE) as operator:
        assert operator.load_adapter("good", pin=True).name == "good"
        operator.unload_adapter("good")
        assert "good" not in {a.name for a in operator.list_adapters()[0]}


def test_a_worker_without_the_stores_read_token_cannot_fetch(
    secured: Secured, tiny_model: Path, tmp_path: Path
) -> None:
    settings = WorkerSettings(
        model=str(tiny_model), served_model_name="tiny", port=0, store=secured.store,
        max_loras=2, kv_cache_bytes=8 << 20, model_cache_dir=tmp_path / "models-2",
    )
    server, port, engine = create_worker(settings, build_engine(settings, checkpoint=tiny_model))
    server.start()
    try:
        with WorkerClient(f"127.0.0.1:{port}") as client:  # the worker has no token: open
            with pytest.raises(errors.Unauthenticated):
                client.load_adapter("good")
    finally:
        server.stop(None).wait()
        engine.stop()


# -- issue 55: a worker started alone, with no token, is closed unless told otherwise -----------
@pytest.mark.parametrize("insecure_no_auth", [False, True], ids=["default", "insecure-no-auth"])
def test_a_worker_with_no_token_loads_for_no_one_unless_opened_explicitly(
    tiny_model: Path, tiny_adapters: dict[str, Path], tmp_path: Path, insecure_no_auth: bool,
    reference: dict[tuple[str, int], list[int]],
) -> None:
    """What `lorastream worker serve` does without tokens; generation is served either way."""
    settings = WorkerSettings(
        model=str(tiny_model), served_model_name="tiny", port=0, max_loras=2,
        kv_cache_bytes=8 << 20, model_cache_dir=tmp_path / "models",
        insecure_no_auth=insecure_no_auth,  # tests/conftest.py opens test workers by default
    )
    server, port, engine = create_worker(settings, build_engine(settings, checkpoint=tiny_model))
    server.start()
    worker = f"127.0.0.1:{port}"
    try:
        with WorkerClient(worker) as anyone:
            if insecure_no_auth:
                loaded = anyone.load_adapter("local", local_path=str(tiny_adapters["attn-r4"]))
                assert loaded.name == "local"
                assert _greedy(worker, "local") == reference[("attn-r4", 0)]
                anyone.unload_adapter("local")
            else:
                for call in (
                    lambda: anyone.load_adapter("local",
                                                local_path=str(tiny_adapters["attn-r4"])),
                    lambda: anyone.unload_adapter("local"),
                ):
                    with pytest.raises(errors.Unauthenticated,
                                       match=r"LORASTREAM_WORKER_TOKEN.*--insecure-no-auth"):
                        call()
                assert "local" not in {a.name for a in anyone.list_adapters()[0]}
        assert len(_greedy(worker, "tiny")) == NEW_TOKENS
    finally:
        server.stop(None).wait()
        engine.stop()


def test_worker_serve_help_says_how_to_open_loading_to_anyone() -> None:
    from typer.testing import CliRunner

    from lorastream.cli.main import app

    result = CliRunner().invoke(app, ["worker", "serve", "--help"], terminal_width=200)
    text = " ".join(result.output.split())
    assert "--insecure-no-auth / --no-insecure-no-auth Serve with no operate token" in text
    assert "a worker with no token refuses LoadAdapter, UnloadAdapter" in text
