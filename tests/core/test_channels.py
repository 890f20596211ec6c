"""The clients' gRPC channels (``lorastream.core.tls``): a channel opened to a server that came
back at the address of one that died connects to it at once, though an older channel to the
dead server is still backing off; this is why every channel keeps its connections to itself."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent import futures

import grpc
import pytest

from lorastream.core.tls import OWN_CONNECTIONS, channel_options, open_aio_channel, open_channel

METHOD = "/lorastream.test.Echo/Echo"


def _serve(port: int) -> tuple[grpc.Server, int]:
    """An echo server on 127.0.0.1:``port`` (0: any free port), started; and its port."""
    handler = grpc.method_handlers_generic_handler(
        "lorastream.test.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(lambda req, _: req)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(2), options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((handler,))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, bound


def _restart(port: int) -> grpc.Server:
    """A new server started at ``port``, where one has just stopped."""
    server, again = _serve(port)
    assert again == port
    return server


def _after_restart_blocking(ours: bool) -> bytes | grpc.StatusCode:
    """A blocking channel sees its server die; a new server starts at that address; a new channel
    (``open_channel``'s if ``ours``, else gRPC's default) calls it: its reply, or the error."""
    first, port = _serve(0)
    target = f"127.0.0.1:{port}"
    second = None
    with grpc.insecure_channel(target) as old:
        assert old.unary_unary(METHOD)(b"first", timeout=5) == b"first"
        first.stop(None)
        time.sleep(0.2)  # the channel sees the connection close
        with pytest.raises(grpc.RpcError) as refused:  # its connection fails: backoff
            old.unary_unary(METHOD)(b"to nobody", timeout=2)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        try:
            second = _restart(port)
            new = open_channel(target, None) if ours else grpc.insecure_channel(target)
            with new:
                return new.unary_unary(METHOD)(b"hello again", timeout=5)
        except grpc.RpcError as err:
            return err.code()
        finally:
            if second is not None:
                second.stop(None)


def _after_restart_asyncio(ours: bool) -> bytes | grpc.StatusCode:
    """The same with asyncio channels (the gateway's), ``open_aio_channel``'s if ``ours``."""

    async def scenario() -> bytes | grpc.StatusCode:
        first, port = _serve(0)
        target = f"127.0.0.1:{port}"
        second = None
        async with grpc.aio.insecure_channel(target) as old:
            assert await old.unary_unary(METHOD)(b"first", timeout=5) == b"first"
            first.stop(None)
            await asyncio.sleep(0.2)
            with pytest.raises(grpc.RpcError) as refused:
                await old.unary_unary(METHOD)(b"to nobody", timeout=2)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            try:
                second = _restart(port)
                new = open_aio_channel(target, None) if ours else grpc.aio.insecure_channel(target)
                async with new:
                    return await new.unary_unary(METHOD)(b"hello again", timeout=5)
            except grpc.RpcError as err:
                return err.code()
            finally:
                if second is not None:
                    second.stop(None)

    return asyncio.run(scenario())


SCENARIOS = pytest.mark.parametrize(
    "after_restart", [_after_restart_blocking, _after_restart_asyncio], ids=["blocking", "asyncio"]
)


@SCENARIOS
def test_a_new_channel_reaches_a_server_restarted_at_a_dead_ones_address(
    after_restart: Callable[[bool], bytes | grpc.StatusCode],
) -> None:
    assert after_restart(True) == b"hello again"


@SCENARIOS
def test_with_grpcs_shared_connections_the_same_new_channel_is_refused(
    after_restart: Callable[[bool], bytes | grpc.StatusCode],
) -> None:
    # what lorastream's channels are kept from: a default channel takes the shared connection
    # that failed, and its first call is refused though the server is up
    assert after_restart(False) == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ((), [OWN_CONNECTIONS]),
        ((("grpc.max_receive_message_length", 8),),
         [("grpc.max_receive_message_length", 8), OWN_CONNECTIONS]),
        (((OWN_CONNECTIONS[0], 0),), [(OWN_CONNECTIONS[0], 0)]),  # the caller's choice stays
    ],
)
def test_channel_options_add_own_connections_unless_the_caller_chose(
    given: tuple[tuple[str, object], ...], expected: list[tuple[str, object]]
) -> None:
    assert channel_options(given) == expected
