"""The worker's gRPC service and CLI on loopback, with adapters streamed from a real store."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from typer.testing import CliRunner

from lorastream.cli.main import app
from lorastream.core import errors
from lorastream.core.generation import PromptInput, SamplingParams
from lorastream.core.store_client import StoreClient
from lorastream.core.worker_client import WorkerClient
from lorastream.store.config import StoreSettings
from lorastream.store.server import create_server as create_store
from lorastream.worker.engine.engine import Engine
from lorastream.worker.service.config import WorkerSettings
from lorastream.worker.service.server import create_server as create_worker
from tests.worker.conftest import NEW_TOKENS, PROMPTS


@dataclass
class Stack:
    store: str
    worker: str
    engine: Engine
    store_server: grpc.Server


def _preload(store: str, uri: Path, name: str, force: bool = False) -> None:
    with StoreClient(store) as client:
        for _ in client.preload(str(uri), name, force=force):
            pass


@pytest.fixture
def stack(tiny_model: Path, tiny_adapters: dict[str, Path], tmp_path: Path) -> Iterator[Stack]:
    store_server, store_port, _ = create_store(
        StoreSettings(port=0, cache_dir=tmp_path / "store")
    )
    store_server.start()
    store = f"127.0.0.1:{store_port}"
    for name in ("attn-r4", "all-r16-rslora"):
        _preload(store, tiny_adapters[name], name)
    settings = WorkerSettings(
        model=str(tiny_model), served_model_name="tiny", port=0, store=store, max_loras=2,
        kv_cache_bytes=8 << 20, model_cache_dir=tmp_path / "models",
    )
    from lorastream.worker.service.bootstrap import build_engine

    server, port, engine = create_worker(settings, build_engine(settings, checkpoint=tiny_model))
    server.start()
    yield Stack(store, f"127.0.0.1:{port}", engine, store_server)
    server.stop(None).wait()
    engine.stop()
    store_server.stop(None).wait()


def _generate(worker: str, model: str, prompt: int = 0, **params: object) -> tuple[list[int], str]:
    sampling = SamplingParams(**{"max_tokens": NEW_TOKENS, **params})  # type: ignore[arg-type]  # params: SamplingParams' own fields
    tokens, text = [], ""
    with WorkerClient(worker) as client:
        prompt_input = PromptInput(token_ids=tuple(PROMPTS[prompt]))
        for event in client.generate(model, prompt_input, sampling):
            tokens.extend(event.token_ids)
            text += event.text
    return tokens, text


def test_adapters_stream_from_the_store_on_first_use_and_match_peft(
    stack: Stack, reference: dict[tuple[str, int], list[int]]
) -> None:
    for name in ("attn-r4", "all-r16-rslora", "tiny"):
        for i in range(len(PROMPTS)):
            tokens, _ = _generate(stack.worker, name, i)
            assert tokens == reference[("base" if name == "tiny" else name, i)], (name, i)


def test_load_list_stats_and_unload(stack: Stack) -> None:
    with WorkerClient(stack.worker) as client:
        status = client.load_adapter("attn-r4")
        assert (status.residency, status.rank, status.slot >= 0) == ("device", 4, True)
        adapters, base = client.list_adapters()
        assert base == "tiny" and [a.name for a in adapters] == ["attn-r4"]
        stats = client.stats()
        assert (stats.device_slots_total, stats.device_slots_used) == (2, 1)
        assert stats.host_bytes_used > 0 and stats.kv_tokens_total > 0
        client.unload_adapter("attn-r4")
        assert client.list_adapters()[0] == []
        with pytest.raises(errors.AdapterNotFound):
            client.unload_adapter("attn-r4")


@pytest.mark.parametrize(
    ("model", "params", "error", "code_text"),
    [
        ("ghost", {}, errors.AdapterNotFound, "ghost"),
        ("tiny", {"top_p": 2.0}, errors.InvalidArgument, "top_p"),
        ("tiny", {"max_tokens": -1}, errors.InvalidArgument, "max_tokens"),
    ],
)
def test_errors_map_to_status_codes_and_the_worker_keeps_serving(
    stack: Stack, model: str, params: dict[str, object], error: type[Exception], code_text: str
) -> None:
    with pytest.raises(error, match=code_text):
        _generate(stack.worker, model, **params)
    assert _generate(stack.worker, "tiny")[0]


def test_an_explicit_max_tokens_0_over_grpc_is_refused_not_read_as_unset(stack: Stack) -> None:
    """A raw client (no WorkerClient) that sets max_tokens 0 gets INVALID_ARGUMENT, not 256
    tokens; leaving it unset still means the worker's default."""
    from lorastream.gpu_worker.v1 import gpu_worker_pb2 as pb
    from lorastream.gpu_worker.v1 import gpu_worker_pb2_grpc as pb_grpc

    def request(**sampling: object) -> pb.GenerateRequest:
        msg = pb.GenerateRequest(model="tiny", sampling=pb.SamplingParams(**sampling))
        msg.prompt_token_ids.ids.extend(PROMPTS[0])
        return msg

    with grpc.insecure_channel(stack.worker) as channel:
        stub = pb_grpc.GpuWorkerServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(request(max_tokens=0)))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_tokens" in (caught.value.details() or "")
        replies = list(stub.Generate(request(max_tokens=3, ignore_eos=True)))
        assert sum(len(r.token_ids) for r in replies) == 3


def test_a_name_replaced_in_the_store_is_served_with_its_new_weights(
    stack: Stack, tiny_adapters: dict[str, Path], reference: dict[tuple[str, int], list[int]]
) -> None:
    assert _generate(stack.worker, "attn-r4")[0] == reference[("attn-r4", 0)]
    _preload(stack.store, tiny_adapters["mlp-r8"], "attn-r4", force=True)
    assert _generate(stack.worker, "attn-r4")[0] == reference[("mlp-r8", 0)]


def test_a_dead_store_fails_new_adapters_clearly_while_resident_ones_keep_serving(
    stack: Stack, reference: dict[tuple[str, int], list[int]]
) -> None:
    assert _generate(stack.worker, "attn-r4")[0] == reference[("attn-r4", 0)]
    stack.store_server.stop(None).wait()
    with pytest.raises(errors.SourceUnavailable):
        _generate(stack.worker, "all-r16-rslora")
    assert _generate(stack.worker, "attn-r4")[0] == reference[("attn-r4", 0)]
    assert _generate(stack.worker, "tiny")[0] == reference[("base", 0)]


def test_a_client_going_away_cancels_its_request(stack: Stack) -> None:
    with WorkerClient(stack.worker) as client:
        events = client.generate("attn-r4", PromptInput(token_ids=tuple(PROMPTS[0])),
                                 SamplingParams(max_tokens=500, ignore_eos=True))
        next(events)
        events.close()  # cancels the call
    engine = stack.engine
    deadline = time.monotonic() + 5
    while (engine.running or engine.waiting) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.running == 0 and engine.kv.allocator.used_blocks == 0
    assert engine.adapters.usage().references == 0


def test_health_and_reflection_are_served(stack: Stack) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(stack.worker) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        answer = next(stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    services = {s.name for s in answer.list_services_response.service}
    assert "lorastream.gpu_worker.v1.GpuWorkerService" in services


def test_complete_cli_prints_json_with_the_generated_tokens(stack: Stack) -> None:
    with WorkerClient(stack.worker) as client:
        events = list(client.generate(
            "attn-r4", PromptInput(text="Hello there"), SamplingParams(max_tokens=8)))
    expected = {
        "text": "".join(e.text for e in events),
        "token_ids": [t for e in events for t in e.token_ids],
    }
    runner = CliRunner()
    result = runner.invoke(app, [
        "complete", "--worker", stack.worker, "--model", "attn-r4", "--prompt", "Hello there",
        "--max-tokens", "8", "--json",
    ])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip().splitlines()[-1]) == expected
    streamed = runner.invoke(app, [
        "complete", "--worker", stack.worker, "--model", "attn-r4", "--prompt", "Hello there",
        "--max-tokens", "8", "--stream",
    ])
    assert streamed.exit_code == 0 and expected["text"] in streamed.output
    missing = runner.invoke(app, [
        "complete", "--worker", stack.worker, "--model", "ghost", "--prompt", "Hello",
    ])
    assert missing.exit_code == 1 and "AdapterNotFound" in missing.output


@pytest.mark.parametrize("role", ["store", "worker"])
def test_a_second_server_on_a_port_in_use_fails_naming_the_port(
    stack: Stack, tmp_path: Path, role: str
) -> None:
    target = stack.store if role == "store" else stack.worker
    port = int(target.rsplit(":", 1)[1])
    with pytest.raises(errors.InvalidArgument, match=rf"127\.0\.0\.1:{port}: address in use"):
        if role == "store":
            create_store(StoreSettings(host="127.0.0.1", port=port, cache_dir=tmp_path / "second"))
        else:
            create_worker(
                WorkerSettings(host="127.0.0.1", port=port, model_cache_dir=tmp_path / "m"),
                stack.engine, start_engine=False,
            )
    with grpc.insecure_channel(target) as channel:  # the first one still serves
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
