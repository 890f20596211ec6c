"""Thin gRPC servicer of the GPU worker: convert the request, call the core, convert the reply."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import grpc

from lorastream.core import worker_codec
from lorastream.core.auth import Scope
from lorastream.gpu_worker.v1 import gpu_worker_pb2 as pb
from lorastream.gpu_worker.v1 import gpu_worker_pb2_grpc as pb_grpc
from lorastream.worker.engine.engine import Engine
from lorastream.worker.service import tokenization
from lorastream.worker.service.drain import WorkerDrain
from lorastream.worker.service.operations import WorkerOperations

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["GpuWorkerService"]
SERVICE_NAME = SERVICE.full_name
# The scope each method needs when the worker has a token (lorastream/core/auth.py): loading
# chooses which weights answer for a name, so only operators may do it. Generation, listing and
# stats stay open to whoever reaches the port (the gateway; keep the port private).
REQUIRED_SCOPES = {
    f"/{SERVICE_NAME}/{m}": Scope.OPERATE
    for m in ("LoadAdapter", "UnloadAdapter", "ResetPrefixCache")
}


class GpuWorkerServicer(pb_grpc.GpuWorkerServiceServicer):
    def __init__(self, engine: Engine, drain: WorkerDrain | None = None) -> None:
        self._engine = engine
        self._ops = WorkerOperations(engine)
        self._drain = drain  # refuses new generations once the worker drains

    def Generate(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        if self._drain is not None:
            self._drain.refuse_if_draining()
        request_id, model, prompt, params, mix = worker_codec.generate_request_from_pb(request)
        stream = self._engine.submit(model, prompt, params, request_id or None, mix)
        # The client going away (or the deadline passing) cancels the request at once.
        context.add_callback(stream.cancel)
        for event in stream:
            yield worker_codec.event_to_pb(event)

    def LoadAdapter(
        self, request: pb.LoadAdapterRequest, context: grpc.ServicerContext
    ) -> pb.LoadAdapterResponse:
        status = self._ops.load_adapter(request.name, request.local_path, request.pin)
        return pb.LoadAdapterResponse(adapter=worker_codec.adapter_status_to_pb(status))

    def UnloadAdapter(
        self, request: pb.UnloadAdapterRequest, context: grpc.ServicerContext
    ) -> pb.UnloadAdapterResponse:
        self._ops.unload_adapter(request.name)
        return pb.UnloadAdapterResponse()

    def ResetPrefixCache(
        self, request: pb.ResetPrefixCacheRequest, context: grpc.ServicerContext
    ) -> pb.ResetPrefixCacheResponse:
        self._ops.reset_prefix_cache()
        return pb.ResetPrefixCacheResponse()

    def ListAdapters(
        self, request: pb.ListAdaptersRequest, context: grpc.ServicerContext
    ) -> pb.ListAdaptersResponse:
        return worker_codec.adapter_list_to_pb(
            self._ops.list_adapters(), self._engine.base_model_name, self._ops.base_shape()
        )

    def GetStats(
        self, request: pb.GetStatsRequest, context: grpc.ServicerContext
    ) -> pb.GetStatsResponse:
        return worker_codec.stats_to_pb(self._ops.stats())

    def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.ServicerContext
    ) -> pb.TokenizeResponse:
        tokenize = worker_codec.tokenize_request_from_pb(request)
        tokenizer = self._engine.tokenizer_for(tokenize.model)
        return worker_codec.tokenized_to_pb(
            tokenization.tokenize(self._engine.intake, tokenize, tokenizer))

    def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.ServicerContext
    ) -> pb.DetokenizeResponse:
        return pb.DetokenizeResponse(
            prompt=tokenization.detokenize(self._engine.intake, list(request.tokens),
                                           self._engine.tokenizer_for(request.model))
        )
