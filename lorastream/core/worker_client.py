"""Blocking client of ``GpuWorkerService`` for the CLI, the stack and the benchmarks; raises
domain errors. The gateway uses its asyncio counterpart, ``gateway/async_worker_client.py``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc

from lorastream.core import worker_codec
from lorastream.core.adapter_mix import parse_mix_model
from lorastream.core.generation import (
    AdapterStatus,
    GenerationEvent,
    PromptInput,
    SamplingParams,
    WorkerStats,
)
from lorastream.core.grpc_status import raise_from_rpc_error
from lorastream.core.tls import ClientTLS, open_channel
from lorastream.core.tokenization import Tokenized, TokenizeInput
from lorastream.gpu_worker.v1 import gpu_worker_pb2 as pb
from lorastream.gpu_worker.v1 import gpu_worker_pb2_grpc as pb_grpc

GRPC_OPTIONS = [("grpc.max_receive_message_length", 16 << 20)]


class WorkerClient:
    def __init__(self, target: str, timeout: float = 30.0,
                 tls: ClientTLS | None = None, token: str | None = None) -> None:
        self.target = target
        # the operate token, sent on unary calls (load and unload need it)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._channel = open_channel(target, tls, GRPC_OPTIONS)  # tls None: plaintext
        self._stub = pb_grpc.GpuWorkerServiceStub(self._channel)
        self._timeout = timeout

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> WorkerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        model: str,
        prompt: PromptInput,
        params: SamplingParams,
        request_id: str = "",
        timeout: float | None = None,
    ) -> Iterator[GenerationEvent]:
        """Stream the generation; closing the iterator early cancels the request."""
        request = worker_codec.generate_request_to_pb(
            model, prompt, params, request_id, parse_mix_model(model) or ()
        )
        call = self._stub.Generate(request, timeout=timeout)
        try:
            for msg in call:
                yield worker_codec.event_from_pb(msg)
        except grpc.RpcError as err:
            raise_from_rpc_error(err)
        finally:
            call.cancel()

    def load_adapter(self, name: str, local_path: str = "", pin: bool = False) -> AdapterStatus:
        request = pb.LoadAdapterRequest(name=name, local_path=local_path, pin=pin)
        reply = self._call(self._stub.LoadAdapter, request, timeout=600.0)
        return worker_codec.adapter_status_from_pb(reply.adapter)

    def unload_adapter(self, name: str) -> None:
        self._call(self._stub.UnloadAdapter, pb.UnloadAdapterRequest(name=name))

    def reset_prefix_cache(self) -> None:
        """Forget the worker's cached prompt prefixes (needs the operate token)."""
        self._call(self._stub.ResetPrefixCache, pb.ResetPrefixCacheRequest())

    def list_adapters(self) -> tuple[list[AdapterStatus], str]:
        """Adapters on the worker, and its base model's served name."""
        reply = self._call(self._stub.ListAdapters, pb.ListAdaptersRequest())
        return [worker_codec.adapter_status_from_pb(a) for a in reply.adapters], reply.base_model

    def stats(self) -> WorkerStats:
        return worker_codec.stats_from_pb(self._call(self._stub.GetStats, pb.GetStatsRequest()))

    def tokenize(self, request: TokenizeInput) -> Tokenized:
        reply = self._call(self._stub.Tokenize, worker_codec.tokenize_request_to_pb(request))
        return worker_codec.tokenized_from_pb(reply, request.return_token_strs)

    def detokenize(self, tokens: list[int], model: str = "") -> str:
        reply = self._call(self._stub.Detokenize, pb.DetokenizeRequest(tokens=tokens,
                                                                        model=model))
        return str(reply.prompt)

    def _call(self, method: Any, request: Any, timeout: float | None = None) -> Any:
        try:
            return method(request, timeout=timeout or self._timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            raise_from_rpc_error(err)
