"""TLS and mutual TLS on every hop, with real certificates from the stack's generator: the store
and the worker over gRPC, the gateway over HTTPS, and a completion through all three; clients that
do not trust the server, or that the server does not trust, are refused with a clear error."""

from __future__ import annotations

import asyncio
import ssl
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
import uvicorn
from grpc_health.v1 import health_pb2, health_pb2_grpc
from typer.testing import CliRunner

from lorastream.cli.main import app
from lorastream.cli.settings_flags import setting_flags
from lorastream.core.errors import InvalidArgument, ServerUnreachable
from lorastream.core.generation import PromptInput, SamplingParams
from lorastream.core.store_client import StoreClient
from lorastream.core.tls import ClientTLS, ServerTLS, https_context, open_aio_channel
from lorastream.core.worker_client import WorkerClient
from lorastream.gateway.app import create_app
from lorastream.gateway.async_worker_client import AsyncWorkerClient
from lorastream.gateway.config import GatewaySettings
from lorastream.gateway.discovery import TargetResolver
from lorastream.gateway.server import https_options
from lorastream.stack.certs import LocalCerts, issue, make_ca, make_local_certs
from lorastream.store.config import StoreSettings
from lorastream.store.server import create_server as create_store
from lorastream.worker.service.bootstrap import build_engine
from lorastream.worker.service.config import WorkerSettings
from lorastream.worker.service.server import create_server as create_worker
from tests.support.models import make_peft_adapter, make_tiny_checkpoint

BASE = "tiny"
ADAPTER = "demo"
HEALTHCHECK_SCRIPT = Path(__file__).resolve().parents[2] / "docker" / "healthcheck.py"


@dataclass(frozen=True)
class PKI:
    local: LocalCerts
    intruder_ca: Path  # a CA nobody here trusts
    intruder_cert: Path  # a client certificate it signed
    intruder_key: Path

    @property
    def client(self) -> ClientTLS:
        tls = ClientTLS.from_files(self.local.ca, self.local.client_cert, self.local.client_key)
        assert tls is not None
        return tls


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    root = tmp_path_factory.mktemp("pki")
    local = make_local_certs(root / "local")
    intruder = make_ca(root, "intruder CA", "intruder-ca.pem")
    cert, key = issue(intruder, root, "intruder", client=True)
    return PKI(local, intruder.cert, cert, key)


def start_store(root: Path, certs: LocalCerts, mutual: bool) -> tuple[grpc.Server, str]:
    settings = StoreSettings(
        port=0, cache_dir=root / "store", tls_cert=certs.server_cert, tls_key=certs.server_key,
        tls_client_ca=certs.ca if mutual else None,
    )
    server, port, _ = create_store(settings)
    server.start()
    return server, f"localhost:{port}"


@pytest.fixture(scope="module")
def mtls_store(pki: PKI, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server, target = start_store(tmp_path_factory.mktemp("mtls-store"), pki.local, mutual=True)
    yield target
    server.stop(None).wait()


def test_local_certificates_are_private_to_their_owner(pki: PKI) -> None:
    directory = pki.local.ca.parent
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for key in (pki.local.server_key, pki.local.client_key):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600


def test_a_client_with_the_stacks_ca_and_certificate_reaches_a_mutual_tls_store(
    pki: PKI, mtls_store: str
) -> None:
    with StoreClient(mtls_store, tls=pki.client) as client:
        adapters, _, budget = client.list()
    assert adapters == [] and budget > 0


@pytest.mark.parametrize(
    ("case", "hint"),
    [
        ("plaintext", "connect with --tls-ca"),
        ("no client certificate", "--tls-client-cert"),
        ("client certificate from another CA", "--tls-client-cert"),
        ("server not trusted", "TLS handshake failed"),
    ],
)
def test_a_mutual_tls_store_refuses_clients_it_or_they_do_not_trust(
    pki: PKI, mtls_store: str, case: str, hint: str
) -> None:
    local = pki.local
    tls = {
        "plaintext": None,
        "no client certificate": ClientTLS.from_files(local.ca),
        "client certificate from another CA": ClientTLS.from_files(
            local.ca, pki.intruder_cert, pki.intruder_key
        ),
        "server not trusted": ClientTLS.from_files(
            pki.intruder_ca, local.client_cert, local.client_key
        ),
    }[case]
    with StoreClient(mtls_store, tls=tls, timeout=5) as client:
        with pytest.raises(ServerUnreachable, match=hint):
            client.list()


def test_a_tls_store_without_client_ca_takes_any_client_that_trusts_it(
    pki: PKI, tmp_path: Path
) -> None:
    server, target = start_store(tmp_path, pki.local, mutual=False)
    try:
        with StoreClient(target, tls=ClientTLS.from_files(pki.local.ca)) as client:
            assert client.list()[0] == []
    finally:
        server.stop(None).wait()


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("files", "message"),
    [
        (lambda c, t: ServerTLS.from_files(t / "missing.pem", c.server_key),
         "--tls-cert .*missing.pem: no such file"),
        (lambda c, t: ServerTLS.from_files(c.server_cert, None), "--tls-cert needs --tls-key"),
        (lambda c, t: ServerTLS.from_files(None, None, c.ca), "--tls-client-ca needs --tls-cert"),
        (lambda c, t: ServerTLS.from_files(c.server_cert, c.client_key),
         "--tls-cert .* / --tls-key .*: not a certificate and its private key"),
        (lambda c, t: ServerTLS.from_files(_write(t / "x.pem", "hello"), c.server_key),
         "--tls-cert .*x.pem: not a PEM file"),
        (lambda c, t: ServerTLS.from_files(c.server_cert, c.server_key, c.server_key),
         "--tls-client-ca .*: not a PEM CA certificate"),
        (lambda c, t: ClientTLS.from_files(t / "nope.pem", prefix="--store-"),
         "--store-tls-ca .*nope.pem: no such file"),
        (lambda c, t: ClientTLS.from_files(c.ca, None, c.client_key, prefix="--worker-"),
         "--worker-tls-client-key needs --worker-tls-client-cert"),
    ],
    ids=["missing", "no key", "client ca alone", "key of another cert", "not pem", "ca not a ca",
         "store prefix", "worker prefix"],
)
def test_wrong_tls_files_are_refused_naming_the_flag_and_the_path(
    pki: PKI, tmp_path: Path, files: object, message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        files(pki.local, tmp_path)  # type: ignore[operator]  # files: typed object, a callable from the parametrize list


def test_a_store_with_a_wrong_certificate_path_does_not_start(tmp_path: Path) -> None:
    settings = StoreSettings(port=0, cache_dir=tmp_path, tls_cert=tmp_path / "c.pem",
                             tls_key=tmp_path / "k.pem")
    with pytest.raises(InvalidArgument, match="--tls-cert"):
        create_store(settings)


def test_the_cli_reports_a_missing_ca_file_in_one_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["adapters", "ls", "--store", "localhost:1", "--tls-ca", str(tmp_path / "ca.pem")]
    )
    assert result.exit_code == 1
    assert "--tls-ca" in result.output and "no such file" in result.output


@pytest.mark.parametrize(
    ("settings", "flags"),
    [
        (StoreSettings, {"--tls-cert", "--tls-key", "--tls-client-ca"}),
        (WorkerSettings, {"--tls-cert", "--tls-key", "--tls-client-ca", "--store-tls-ca",
                          "--store-tls-client-cert", "--store-tls-client-key"}),
        (GatewaySettings, {"--tls-cert", "--tls-key", "--tls-client-ca", "--worker-tls-ca",
                           "--worker-tls-client-cert", "--worker-tls-client-key",
                           "--store-tls-ca", "--store-tls-client-cert",
                           "--store-tls-client-key"}),
    ],
)
def test_every_service_has_the_standard_tls_flags(settings: type, flags: set[str]) -> None:
    assert flags <= {f.flag for f in setting_flags(settings)}


# -- the whole stack: gateway HTTPS -> worker (mutual TLS) -> store (mutual TLS) ------------------


@dataclass
class Stack:
    store: str
    worker: str
    gateway_settings: GatewaySettings


@pytest.fixture(scope="module")
def tls_stack(
    pki: PKI, mtls_store: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """A worker on the tiny model serving mutual TLS, fetching from the mutual-TLS store through
    its fetch process, with one adapter staged."""
    root = tmp_path_factory.mktemp("tls-stack")
    model = make_tiny_checkpoint(root / "model")
    adapter = make_peft_adapter(model, root / "adapter", rank=4, targets=["q_proj", "v_proj"])
    with StoreClient(mtls_store, tls=pki.client) as client:
        for _ in client.preload(str(adapter), ADAPTER):
            pass
    c = pki.local
    settings = WorkerSettings(
        model=str(model), served_model_name=BASE, port=0, store=mtls_store, max_loras=2,
        kv_cache_bytes=16 << 20, host_cache_bytes=64 << 20, model_cache_dir=root / "models",
        tls_cert=c.server_cert, tls_key=c.server_key, tls_client_ca=c.ca,
        store_tls_ca=c.ca, store_tls_client_cert=c.client_cert, store_tls_client_key=c.client_key,
    )
    assert settings.fetch_process  # the TLS settings travel to the fetch process
    engine = build_engine(settings, checkpoint=model)
    server, port, _ = create_worker(settings, engine)
    server.start()
    worker = f"localhost:{port}"
    gateway = GatewaySettings(
        port=0, workers=[worker], store=mtls_store, poll_interval_s=0.1,
        tls_cert=c.server_cert, tls_key=c.server_key,
        worker_tls_ca=c.ca, worker_tls_client_cert=c.client_cert,
        worker_tls_client_key=c.client_key,
        store_tls_ca=c.ca, store_tls_client_cert=c.client_cert, store_tls_client_key=c.client_key,
    )
    yield Stack(mtls_store, worker, gateway)
    server.stop(None).wait()
    engine.stop()


GREEDY = SamplingParams(temperature=0.0, max_tokens=3)


def test_a_worker_serves_mutual_tls_and_loads_from_a_mutual_tls_store(
    pki: PKI, tls_stack: Stack
) -> None:
    with WorkerClient(tls_stack.worker, tls=pki.client) as client:
        events = list(client.generate(ADAPTER, PromptInput(text="Hello"), GREEDY))
    assert sum(len(e.token_ids) for e in events) >= 1
    with WorkerClient(tls_stack.worker, tls=ClientTLS.from_files(pki.local.ca),
                      timeout=5) as client:
        with pytest.raises(ServerUnreachable, match="--tls-client-cert"):
            client.list_adapters()


def test_the_gateways_async_client_speaks_mutual_tls_to_a_worker(
    pki: PKI, tls_stack: Stack
) -> None:
    async def run() -> tuple[str, bool]:
        good = AsyncWorkerClient(tls_stack.worker, tls=pki.client)
        stranger = AsyncWorkerClient(tls_stack.worker, tls=ClientTLS.from_files(
            pki.local.ca, pki.intruder_cert, pki.intruder_key))
        try:
            _, base, _ = await good.list_adapters()
            return base, await stranger.healthy(2.0)
        finally:
            await good.close()
            await stranger.close()

    base, stranger_healthy = asyncio.run(run())
    assert base == BASE and not stranger_healthy


def serve_gateway(settings: GatewaySettings) -> tuple[uvicorn.Server, threading.Thread, int]:
    config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=0, log_config=None,
                            timeout_graceful_shutdown=2, **https_options(settings))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the gateway did not start"
        time.sleep(0.02)
    return server, thread, server.servers[0].sockets[0].getsockname()[1]


@pytest.mark.parametrize("mutual", [False, True], ids=["https", "https with client certificates"])
def test_a_completion_goes_over_https_and_tls_through_gateway_worker_and_store(
    pki: PKI, tls_stack: Stack, mutual: bool
) -> None:
    c = pki.local
    settings = tls_stack.gateway_settings.model_copy(
        update={"tls_client_ca": c.ca if mutual else None}
    )
    server, thread, port = serve_gateway(settings)
    url = f"https://localhost:{port}"
    trusted = https_context(c.ca, c.client_cert, c.client_key) if mutual else https_context(c.ca)
    try:
        with httpx.Client(base_url=url, verify=trusted, timeout=30) as http:
            deadline = time.monotonic() + 20
            while http.get("/health").status_code != 200:  # the worker is polled healthy
                assert time.monotonic() < deadline
                time.sleep(0.1)
            assert ADAPTER in {m["id"] for m in http.get("/v1/models").json()["data"]}  # store
            reply = http.post("/v1/completions", json={
                "model": ADAPTER, "prompt": "Hello", "max_tokens": 3, "temperature": 0,
            })
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] >= 1
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{url}/health", verify=ssl.create_default_context())  # system roots
        if mutual:  # trusts the gateway, but shows no certificate of its own
            with pytest.raises((httpx.ReadError, httpx.ConnectError, httpx.RemoteProtocolError)):
                httpx.get(f"{url}/health", verify=https_context(c.ca))
    finally:
        server.should_exit = True
        thread.join(timeout=15)


def test_a_worker_resolved_to_an_address_is_checked_against_the_name_it_was_resolved_from(
    pki: PKI, tmp_path: Path
) -> None:
    """A headless Service: the gateway dials pod IPs whose certificates name the Service."""
    ca = make_ca(tmp_path, "service CA", "service-ca.pem")
    cert, key = issue(ca, tmp_path, "workers", hosts=["workers.lorastream.svc"])
    settings = StoreSettings(port=0, cache_dir=tmp_path / "store", tls_cert=cert, tls_key=key)
    server, port, _ = create_store(settings)
    server.start()

    async def dns(target: str) -> list[str]:
        return [f"127.0.0.1:{port}"]

    async def serving(server_name: str | None) -> bool:
        tls = ClientTLS.from_files(ca.cert)
        async with open_aio_channel(f"127.0.0.1:{port}", tls, server_name=server_name) as channel:
            try:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
            except grpc.RpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def run() -> tuple[str | None, bool, bool]:
        resolver = TargetResolver([f"workers.lorastream.svc:{port}"], dns)
        [address] = await resolver.resolve()
        name = resolver.name_of(address)
        return name, await serving(name), await serving(None)

    try:
        name, with_name, without = asyncio.run(run())
    finally:
        server.stop(None).wait()
    assert name == "workers.lorastream.svc"
    assert with_name and not without


@pytest.mark.parametrize("mutual", [True, False], ids=["client certificate", "none"])
def test_the_container_healthcheck_speaks_mutual_tls(
    pki: PKI, mtls_store: str, mutual: bool
) -> None:
    c = pki.local
    identity = ["--tls-client-cert", str(c.client_cert), "--tls-client-key", str(c.client_key)]
    result = subprocess.run(
        [sys.executable, str(HEALTHCHECK_SCRIPT), mtls_store, "--timeout", "5",
         "--tls-ca", str(c.ca), *(identity if mutual else [])],
        capture_output=True, text=True, timeout=30, check=False,
    )
    assert result.returncode == (0 if mutual else 1), result.stderr
    assert ("SERVING" if mutual else "UNAVAILABLE") in result.stderr
