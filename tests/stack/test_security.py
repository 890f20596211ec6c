"""Issue 28, secure by default: the store's scoped tokens, its allowed local roots, and the
refusal to serve other hosts without tokens, against real servers on port 0.

Each attack here succeeded before the fix: the store's reads had no token check
(``OPERATOR_METHODS`` listed only preload, delete, pin, unpin), any absolute path was staged,
and nothing looked at the bound address. The worker's load/unload are in
tests/worker/service/test_worker_auth.py, the gateway's API keys and /v1/models in
tests/gateway/test_gateway_auth.py, `lorastream up`'s generated tokens in tests/stack/test_stack.py.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lorastream.core import errors
from lorastream.core.auth import AccessTokens, Scope, is_loopback, read_token_file
from lorastream.core.store_client import BytesSink, StoreClient
from lorastream.gateway.app import create_app
from lorastream.gateway.config import GatewaySettings
from lorastream.stack.access import local_roots, stack_tokens
from lorastream.stack.launcher import SAMPLES_DIR, StackConfig
from lorastream.store.config import StoreSettings
from lorastream.store.server import create_server
from lorastream.worker.service.config import WorkerSettings
from lorastream.worker.service.server import create_server as create_worker
from tests.support.models import ATTENTION, make_peft_adapter, make_tiny_llama

OPERATE, READ = "operate-secret-0123", "read-secret-4567"


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("security")
    base = make_tiny_llama(root / "base")
    return make_peft_adapter(base, root / "roots" / "attn-r4", rank=4, targets=ATTENTION)


@pytest.fixture
def store(adapter: Path, tmp_path: Path) -> Iterator[str]:
    """A store with both tokens, ``adapter`` staged as ``good``; local paths only under the
    adapter's parent directory."""
    settings = StoreSettings(port=0, cache_dir=tmp_path / "cache", token=OPERATE,
                             read_token=READ, allowed_local_roots=[adapter.parent])
    server, port, _ = create_server(settings)
    server.start()
    target = f"127.0.0.1:{port}"
    with StoreClient(target, OPERATE) as operator:
        for _ in operator.preload(str(adapter), "good"):
            pass
    yield target
    server.stop(None).wait()


READS: dict[str, Callable[[StoreClient], Any]] = {
    "list": lambda c: c.list(),
    "describe": lambda c: c.describe("good"),
    "stream-weights": lambda c: c.stream_tensors("good", BytesSink()),
}
OPERATIONS: dict[str, Callable[[StoreClient], Any]] = {
    "preload": lambda c: list(c.preload("/etc", "evil")),
    "pin": lambda c: c.pin("good"),
    "unpin": lambda c: c.unpin("good"),
    "delete": lambda c: c.delete("good"),
}


@pytest.mark.parametrize("call", list(READS), ids=list(READS))
@pytest.mark.parametrize(("token", "allowed"), [
    (None, False), ("wrong", False), (READ, True), (OPERATE, True),
], ids=["anonymous", "wrong", "read", "operate"])
def test_store_reads_need_a_read_or_operate_token(
    store: str, call: str, token: str | None, allowed: bool
) -> None:
    """Finding 2: whoever reached the port could list and download every adapter."""
    with StoreClient(store, token) as client:
        if allowed:
            READS[call](client)
        else:
            with pytest.raises(errors.Unauthenticated):
                READS[call](client)


@pytest.mark.parametrize("call", list(OPERATIONS), ids=list(OPERATIONS))
@pytest.mark.parametrize("token", [None, "wrong", READ], ids=["anonymous", "wrong", "read"])
def test_store_operator_calls_refuse_all_but_the_operate_token(
    store: str, call: str, token: str | None
) -> None:
    with StoreClient(store, token) as client, pytest.raises(errors.Unauthenticated) as refused:
        OPERATIONS[call](client)
    if token == READ:
        assert "read-only" in str(refused.value)
    with StoreClient(store, OPERATE) as operator:  # nothing changed
        assert operator.describe("good").pinned is False


def test_tokens_are_never_logged(
    adapter: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    settings = StoreSettings(port=0, cache_dir=tmp_path / "cache", token=OPERATE,
                             read_token=READ, allowed_local_roots=[adapter.parent])
    server, port, _ = create_server(settings)
    server.start()
    try:
        with StoreClient(f"127.0.0.1:{port}", OPERATE) as operator:
            for _ in operator.preload(str(adapter), "good"):
                pass
        for token in (READ, "wrong-guess-89ab"):
            with StoreClient(f"127.0.0.1:{port}", token) as client:
                with pytest.raises(errors.Unauthenticated):
                    client.delete("good")
    finally:
        server.stop(None).wait()
    assert "tokens set: operate, read" in caplog.text  # what is set, at start
    assert "refused" in caplog.text  # refusals are logged, without the token
    for secret in (OPERATE, READ, "wrong-guess-89ab"):
        assert secret not in caplog.text


# -- allowed local roots (finding 6) -------------------------------------------------------------
PROBES = ["/etc", "/nonexistent", "/proc/1", "/root", "file:///etc/passwd"]


def test_paths_outside_the_allowed_roots_are_refused_alike_whether_or_not_they_exist(
    store: str,
) -> None:
    """Before: /etc -> "has no adapter_model.safetensors", /nonexistent -> 404, /proc/1 -> 503
    "Permission denied": the answers mapped the store's file system."""
    messages = set()
    with StoreClient(store, OPERATE) as operator:
        for probe in PROBES:
            with pytest.raises(errors.InvalidArgument) as refused:
                list(operator.preload(probe, "probe"))
            messages.add(str(refused.value).removeprefix(probe))
    assert len(messages) == 1, messages
    assert "allowed local roots" in messages.pop()


def test_a_symlink_out_of_an_allowed_root_is_refused(
    store: str, adapter: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (outside / name).write_bytes((adapter / name).read_bytes())
    linked_dir = adapter.parent / "link-to-outside"
    linked_dir.symlink_to(outside)
    mixed = adapter.parent / "mixed"  # a real directory whose weights file points outside
    mixed.mkdir()
    (mixed / "adapter_config.json").write_bytes((adapter / "adapter_config.json").read_bytes())
    (mixed / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    try:
        with StoreClient(store, OPERATE) as operator:
            for path in (linked_dir, mixed):
                with pytest.raises(errors.InvalidArgument, match="allowed local roots"):
                    list(operator.preload(str(path), "linked"))
            # a path inside a root is staged (the control)
            assert list(operator.preload(str(adapter), "again"))[-1].manifest is not None
    finally:
        linked_dir.unlink()


def test_without_allowed_roots_no_local_path_is_staged(adapter: Path, tmp_path: Path) -> None:
    settings = StoreSettings(port=0, cache_dir=tmp_path / "cache", allowed_local_roots=[])
    server, port, _ = create_server(settings)
    server.start()
    try:
        with StoreClient(f"127.0.0.1:{port}") as client:
            with pytest.raises(errors.InvalidArgument, match=r"allowed local roots \(none\)") as no:
                list(client.preload(str(adapter), "x"))
        # the refusal says how to allow one, for the store and for the stack `up` starts
        assert "start the store with --allowed-local-root DIR" in str(no.value)
        assert "lorastream up --allowed-local-root DIR" in str(no.value)
    finally:
        server.stop(None).wait()


# -- no open server on a non-loopback address (finding 4 and issue item 3) ---------------------
def _start_store(**settings: Any) -> None:
    server, _, _ = create_server(StoreSettings(port=0, **settings))
    server.stop(None)


def _start_worker(**settings: Any) -> None:
    # the check comes before the engine is built: no model is needed to see it refuse; explicit
    # insecure_no_auth, as tests/conftest.py opens test workers
    create_worker(WorkerSettings(port=0, **{"insecure_no_auth": False, **settings}))


def _start_gateway(**settings: Any) -> None:
    create_app(GatewaySettings(port=0, workers=["127.0.0.1:1"], **settings))


STARTERS = {"store": _start_store, "worker": _start_worker, "gateway": _start_gateway}


@pytest.mark.parametrize("part", list(STARTERS))
@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_part_bound_beyond_loopback_refuses_to_start_without_a_token(
    part: str, host: str, tmp_path: Path
) -> None:
    extra = {"cache_dir": tmp_path} if part == "store" else {}
    with pytest.raises(errors.InvalidArgument, match="--insecure-no-auth"):
        STARTERS[part](host=host, **extra)


@pytest.mark.parametrize("part", ["store", "gateway"])
def test_a_token_or_insecure_no_auth_lets_a_non_loopback_part_start(
    part: str, tmp_path: Path
) -> None:
    extra = {"cache_dir": tmp_path} if part == "store" else {}
    STARTERS[part](host="0.0.0.0", token=OPERATE, **extra)
    STARTERS[part](host="0.0.0.0", insecure_no_auth=True, **extra)


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("[::1]", True),
    ("localhost", True), ("0.0.0.0", False), ("::", False), ("10.0.0.5", False),
    ("store.example", False),
])
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


# -- token files, scopes ---------------------------------------------------------------------------
def test_tokens_come_from_files(tmp_path: Path) -> None:
    (tmp_path / "op").write_text(f"{OPERATE}\n")
    (tmp_path / "rd").write_text(f"{READ}\n")
    (tmp_path / "keys").write_text("# inference keys\nkey-a\n\nkey-b\n")
    store = StoreSettings(token_file=tmp_path / "op", read_token_file=tmp_path / "rd")
    assert store.access_tokens() == AccessTokens(operate=OPERATE, read=READ)
    assert WorkerSettings(store_token_file=tmp_path / "rd").store_token == READ
    gateway = GatewaySettings(workers=["w:1"], token_file=tmp_path / "op",
                              api_keys_file=tmp_path / "keys")
    assert (gateway.token, gateway.api_keys) == (OPERATE, ["key-a", "key-b"])
    with pytest.raises(errors.InvalidArgument, match="empty"):
        (tmp_path / "blank").write_text("\n")
        read_token_file(tmp_path / "blank", "--token-file")


@pytest.mark.parametrize(("presented", "scope", "allowed"), [
    (OPERATE, Scope.OPERATE, True), (OPERATE, Scope.READ, True),
    (READ, Scope.READ, True), (READ, Scope.OPERATE, False),
    (None, Scope.READ, False), ("", Scope.READ, False), (OPERATE + "x", Scope.READ, False),
])
def test_an_operate_token_also_reads_and_a_read_token_only_reads(
    presented: str | None, scope: Scope, allowed: bool
) -> None:
    assert AccessTokens(operate=OPERATE, read=READ).allows(presented, scope) is allowed
    assert AccessTokens().allows(presented, scope)  # no token configured: open (loopback dev)


# -- what `lorastream up` sets up (its end-to-end run is tests/stack/test_stack.py) ---------------
def test_up_generates_distinct_tokens_unless_told_not_to() -> None:
    tokens = stack_tokens(None, insecure_no_auth=False)
    assert tokens.operate and tokens.read and tokens.operate != tokens.read
    assert len(tokens.operate) >= 40
    assert stack_tokens(None, insecure_no_auth=False).operate != tokens.operate
    assert stack_tokens("mine", insecure_no_auth=False).operate == "mine"
    assert not stack_tokens(None, insecure_no_auth=True).enabled


def test_up_allows_its_samples_and_the_local_adapters_it_is_given() -> None:
    roots = local_roots(SAMPLES_DIR, {"a": "/data/a", "b": "s3://bucket/b", "c": "file:///data/c"})
    assert roots == [str(SAMPLES_DIR), "/data/a", "/data/c"]


def test_up_allows_the_roots_it_is_given_made_absolute_from_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``up --allowed-local-root``: relative ones from the shell's directory (the store runs
    elsewhere), comma-separated ones split as the store splits them."""
    monkeypatch.chdir(tmp_path)
    roots = local_roots(SAMPLES_DIR, {"a": "/data/a"}, ["mine", "/x,/y", "/data/a"])
    assert roots == [str(SAMPLES_DIR), "/data/a", str(tmp_path / "mine"), "/x", "/y"]


def test_up_passes_tokens_in_the_environment_not_the_command_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lorastream.stack import launcher

    started: list[tuple[list[str], dict[str, str]]] = []

    class Recorded:
        def __init__(self, command: list[str], env: dict[str, str], **options: object) -> None:
            started.append((command, env))

    monkeypatch.setattr(launcher.subprocess, "Popen", Recorded)
    stack = launcher.Stack(StackConfig())
    stack.tokens = stack_tokens(None, insecure_no_auth=False)
    stack._spawn("store", ["store", "serve"], {"LORASTREAM_STORE_TOKEN": stack.tokens.operate})
    (command, env), = started
    assert stack.tokens.operate not in " ".join(command)
    assert env["LORASTREAM_STORE_TOKEN"] == stack.tokens.operate
    assert env.items() >= os.environ.items()
