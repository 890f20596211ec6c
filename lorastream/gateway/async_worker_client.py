"""Asyncio client of one GPU worker (``grpc.aio``); raises domain errors, speaks plain types.

The gateway's counterpart of ``lorastream.core.worker_client.WorkerClient``: the same calls, but
awaitable, so a generation holds no thread and cancelling it (client gone, deadline) cancels the
RPC at once. Protobuf messages are built and read only here and in ``lorastream.core.worker_codec``.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, NoReturn, Protocol, cast

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lorastream.core import worker_codec
from lorastream.core.adapter_fit import BaseShape
from lorastream.core.adapter_mix import parse_mix_model
from lorastream.core.errors import LorastreamError, ServerUnreachable
from lorastream.core.generation import (
    AdapterStatus,
    GenerationEvent,
    PromptInput,
    SamplingParams,
    WorkerStats,
)
from lorastream.core.grpc_status import raise_from_rpc_error
from lorastream.core.tls import ClientTLS, open_aio_channel
from lorastream.core.tokenization import Tokenized, TokenizeInput
from lorastream.gateway.errors import UpstreamTimeout, WorkerFailed, WorkerUnavailable
from lorastream.gpu_worker.v1 import gpu_worker_pb2 as pb
from lorastream.gpu_worker.v1 import gpu_worker_pb2_grpc as pb_grpc

# A restarted worker is found within ~1 s: gRPC's default reconnect backoff grows to 120 s.
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 16 << 20),
    ("grpc.max_send_message_length", 16 << 20),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def raise_domain_error(err: grpc.RpcError, target: str) -> NoReturn:
    """Re-raise a worker's RpcError as a domain error (or WorkerFailed / UpstreamTimeout)."""
    code = err.code() if hasattr(err, "code") else None
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        raise UpstreamTimeout(f"worker {target} did not answer in time: {err.details()}") from err
    try:
        raise_from_rpc_error(err)
    except ServerUnreachable as exc:
        raise WorkerUnavailable(f"worker {target} is unreachable or went away: {exc}") from err
    except LorastreamError:
        raise
    except grpc.RpcError:
        pass
    name = code.name if code is not None else "UNKNOWN"
    details = err.details() if hasattr(err, "details") else str(err)
    raise WorkerFailed(f"worker {target} failed ({name}): {details}") from err


_CheckRequest = health_pb2.HealthCheckRequest
_CheckResponse = health_pb2.HealthCheckResponse


class _HealthStub(Protocol):
    """gRPC health's stub on an aio channel: the two calls this client makes."""

    def Check(
        self, request: _CheckRequest, *, timeout: float | None = None
    ) -> grpc.aio.UnaryUnaryCall[_CheckRequest, _CheckResponse]: ...

    def Watch(
        self, request: _CheckRequest
    ) -> grpc.aio.UnaryStreamCall[_CheckRequest, _CheckResponse]: ...


class Probe(enum.Enum):
    """What one health check of a worker found."""

    SERVING = "serving"
    NOT_SERVING = "not_serving"  # answered, but draining or not ready
    UNREACHABLE = "unreachable"  # no connection: dead, or not started
    SLOW = "slow"  # connected, but no answer in time: busy, not dead


_SERVING = health_pb2.HealthCheckResponse.SERVING


class GenerationCall:
    """One running Generate RPC: iterate for events; ``cancel()`` cancels it on the worker."""

    def __init__(self, call: Any, target: str) -> None:
        self._call = call
        self._target = target
        self.cancelled_locally = False

    def cancel(self) -> None:
        self.cancelled_locally = True
        self._call.cancel()

    async def events(self) -> AsyncGenerator[GenerationEvent, None]:
        """The worker's events; ends quietly when cancelled through :meth:`cancel`."""
        try:
            async for msg in self._call:
                yield worker_codec.event_from_pb(msg)
        except asyncio.CancelledError:
            # grpc.aio raises CancelledError on a call cancelled locally: that ends the stream;
            # a cancellation of the task itself goes on.
            task = asyncio.current_task()
            if self.cancelled_locally and not (task is not None and task.cancelling()):
                return
            raise
        except grpc.RpcError as err:
            if self.cancelled_locally:
                return
            raise_domain_error(err, self._target)
        finally:
            self._call.cancel()  # no-op once finished; cancels the worker request otherwise


class AsyncWorkerClient:
    """Asyncio client of ``GpuWorkerService`` and of the worker's gRPC health service."""

    def __init__(self, target: str, rpc_timeout_s: float = 10.0,
                 tls: ClientTLS | None = None, token: str | None = None, *,
                 server_name: str | None = None) -> None:
        self.target = target
        # the operate token, sent on unary calls (load and unload need it)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        # tls None: plaintext; server_name: what the worker's certificate names (open_aio_channel)
        self._channel = open_aio_channel(target, tls, CHANNEL_OPTIONS, server_name)
        self._stub = pb_grpc.GpuWorkerServiceStub(self._channel)
        # the stubs of grpc_health declare HealthStub without its methods: _HealthStub names them
        self._health = cast("_HealthStub", health_pb2_grpc.HealthStub(self._channel))
        self._timeout = rpc_timeout_s

    async def close(self) -> None:
        await self._channel.close()

    def generate(
        self,
        model: str,
        prompt: PromptInput,
        params: SamplingParams,
        request_id: str = "",
        timeout: float | None = None,
    ) -> GenerationCall:
        request = worker_codec.generate_request_to_pb(
            model, prompt, params, request_id, parse_mix_model(model) or ()
        )
        return GenerationCall(self._stub.Generate(request, timeout=timeout), self.target)

    async def healthy(self, timeout: float) -> bool:
        """True when the worker answers SERVING on gRPC health within ``timeout``."""
        return await self.probe(timeout) is Probe.SERVING

    async def probe(self, timeout: float) -> Probe:
        """One gRPC health check; a deadline passed on a live connection is SLOW, not dead."""
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError as err:
            slow = err.code() is grpc.StatusCode.DEADLINE_EXCEEDED and (
                self._channel.get_state() is grpc.ChannelConnectivity.READY
            )
            return Probe.SLOW if slow else Probe.UNREACHABLE
        return Probe.SERVING if reply.status == _SERVING else Probe.NOT_SERVING

    async def watch_health(self) -> AsyncIterator[bool]:
        """Serving or not, each time the worker's health changes (gRPC health ``Watch``).

        The worker pushes changes on one open stream, so a busy worker never looks dead; the
        stream breaks (RpcError, or it ends) as soon as the connection does: a killed worker is
        known at once. No thread is held on the worker while the stream is open.
        """
        call = self._health.Watch(health_pb2.HealthCheckRequest())
        try:
            async for reply in call:
                yield reply.status == _SERVING
        finally:
            call.cancel()

    async def list_adapters(self) -> tuple[list[AdapterStatus], str, BaseShape]:
        """Adapters on the worker, its base model's served name, and what an adapter must
        match to fit that base."""
        reply = await self._call(self._stub.ListAdapters, pb.ListAdaptersRequest())
        return worker_codec.adapter_list_from_pb(reply)

    async def stats(self) -> WorkerStats:
        reply = await self._call(self._stub.GetStats, pb.GetStatsRequest())
        return worker_codec.stats_from_pb(reply)

    async def load_adapter(self, name: str, pin: bool, timeout: float) -> AdapterStatus:
        request = pb.LoadAdapterRequest(name=name, pin=pin)
        reply = await self._call(self._stub.LoadAdapter, request, timeout)
        return worker_codec.adapter_status_from_pb(reply.adapter)

    async def unload_adapter(self, name: str) -> None:
        await self._call(self._stub.UnloadAdapter, pb.UnloadAdapterRequest(name=name))

    async def reset_prefix_cache(self) -> None:
        await self._call(self._stub.ResetPrefixCache, pb.ResetPrefixCacheRequest())

    async def tokenize(self, request: TokenizeInput) -> Tokenized:
        reply = await self._call(self._stub.Tokenize, worker_codec.tokenize_request_to_pb(request))
        return worker_codec.tokenized_from_pb(reply, request.return_token_strs)

    async def detokenize(self, tokens: list[int], model: str = "") -> str:
        reply = await self._call(self._stub.Detokenize,
                                 pb.DetokenizeRequest(tokens=tokens, model=model))
        return str(reply.prompt)

    async def _call(self, method: Any, request: Any, timeout: float | None = None) -> Any:
        try:
            return await method(request, timeout=timeout or self._timeout,
                                metadata=self._metadata)
        except grpc.RpcError as err:
            raise_domain_error(err, self.target)
