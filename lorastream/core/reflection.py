"""gRPC server reflection under both names clients use: ``grpc.reflection.v1`` and the older
``grpc.reflection.v1alpha``.

grpcio-reflection (1.85.1, the pinned version) ships only v1alpha, but grpcurl, Postman and
recent grpc_cli ask v1 first. The two protocols are the same messages with the same field
numbers under another package name, so the v1 service is v1alpha's servicer registered under the
v1 name: the bytes on the wire are identical. For reflection to describe the v1 service itself,
its file is registered in the default descriptor pool, built from v1alpha's by renaming the
package (``grpc/reflection/v1/reflection.proto``, as upstream names it).
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FileDescriptor
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as alpha_pb

V1_FILE = "grpc/reflection/v1/reflection.proto"
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
V1ALPHA_SERVICE_NAME = reflection.SERVICE_NAME
_METHOD = "ServerReflectionInfo"


def v1_file_descriptor() -> FileDescriptor:
    """The v1 reflection file, added to the default pool on first use."""
    pool = descriptor_pool.Default()
    try:
        return pool.FindFileByName(V1_FILE)
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    alpha_pb.DESCRIPTOR.CopyToProto(proto)
    old, new = f".{alpha_pb.DESCRIPTOR.package}.", f".{V1_PACKAGE}."
    proto.name, proto.package = V1_FILE, V1_PACKAGE
    proto.ClearField("options")  # v1alpha's are deprecated=true and its java/go package names
    for message in proto.message_type:
        for field in message.field:
            if field.type_name:  # message fields only; setting "" would mark a scalar as typed
                field.type_name = field.type_name.replace(old, new, 1)
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new, 1)
            method.output_type = method.output_type.replace(old, new, 1)
    return pool.AddSerializedFile(proto.SerializeToString())


def enable_reflection(server: grpc.Server, service_names: Iterable[str]) -> None:
    """Serve reflection v1 and v1alpha on ``server``, listing ``service_names`` and both
    reflection services."""
    v1_file_descriptor()
    names = (*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
    servicer = reflection.ReflectionServicer(names)
    for service_name in (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME):
        handler = grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=alpha_pb.ServerReflectionRequest.FromString,
            response_serializer=alpha_pb.ServerReflectionResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service_name, {_METHOD: handler}),)
        )
