"""Issue 23 item 6: both servers answer gRPC reflection v1 (what grpcurl and Postman ask first)
and v1alpha. The client is grpc's own reflection client (``ProtoReflectionDescriptorDatabase``
behind a ``DescriptorPool``), speaking over the v1 method path or the v1alpha one, against a real
store server on port 0."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha import reflection_pb2 as alpha_pb
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from lorastream.core.reflection import V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME
from lorastream.store.config import StoreSettings
from lorastream.store.server import create_server

STORE_SERVICE = "lorastream.adapter_store.v1.AdapterStoreService"


class _Stub:
    """A reflection stub for one protocol version: the same messages under another path."""

    def __init__(self, channel: grpc.Channel, service: str) -> None:
        self.ServerReflectionInfo = channel.stream_stream(
            f"/{service}/ServerReflectionInfo",
            request_serializer=alpha_pb.ServerReflectionRequest.SerializeToString,
            response_deserializer=alpha_pb.ServerReflectionResponse.FromString,
        )


@pytest.fixture(scope="module")
def store_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cache = Path(tmp_path_factory.mktemp("reflection")) / "store"
    server, port, _ = create_server(StoreSettings(port=0, cache_dir=cache))
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None).wait()


@pytest.mark.parametrize("version", [V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME], ids=["v1", "v1alpha"])
def test_reflection_lists_and_describes_the_services(store_target: str, version: str) -> None:
    with grpc.insecure_channel(store_target) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        database._stub = _Stub(channel, version)  # the client's one stub, at this version's path
        services = set(database.get_services())
        assert {STORE_SERVICE, "grpc.health.v1.Health", V1_SERVICE_NAME,
                V1ALPHA_SERVICE_NAME} <= services
        pool = DescriptorPool(database)
        store = pool.FindServiceByName(STORE_SERVICE)
        assert "StreamAdapterTensors" in {m.name for m in store.methods}
        v1 = pool.FindServiceByName(V1_SERVICE_NAME)
        assert v1.file.package == "grpc.reflection.v1"
        assert v1.methods[0].input_type.full_name == "grpc.reflection.v1.ServerReflectionRequest"


def test_an_unknown_reflection_version_is_unimplemented(store_target: str) -> None:
    """The check above can fail: a path the server does not serve is refused."""
    with grpc.insecure_channel(store_target) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        database._stub = _Stub(channel, "grpc.reflection.v2.ServerReflection")
        with pytest.raises(grpc.RpcError) as caught:
            list(database.get_services())
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
