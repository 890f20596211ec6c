"""docker-compose.tls.yml, for real: the CPU stack with TLS on every hop (the store and the worker
serve gRPC over mutual TLS, the gateway serves HTTPS and dials them with a client certificate),
checked through the published ports: HTTPS answers with the throwaway CA, a chat request crosses
every hop, and plaintext clients are refused by the gateway and the store.

Certificates from ``lorastream.stack.certs.make_local_certs`` (what `lorastream up --tls` makes) in
a temporary folder: the override is copied there with its secrets pointing at them, so a ./tls/ of
the user's is never touched. Marked and skipped like tests/compose_live/test_compose_live.py.
"""

from __future__ import annotations

import http.client
import os
import ssl
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lorastream.stack.certs import make_local_certs
from tests.compose_live.stack import COMPOSE_FILES, REPO, Compose, Ports, engine_problem

pytestmark = [pytest.mark.compose, pytest.mark.timeout(2400)]

_PROBLEM = engine_problem()
if _PROBLEM:
    pytestmark.append(pytest.mark.skip(reason=_PROBLEM))

UP_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Compose, Path]]:
    directory = tmp_path_factory.mktemp("tls")
    make_local_certs(directory, ["adapter-store", "gpu-worker", "localhost", "127.0.0.1"])
    for key in directory.glob("*-key.pem"):
        key.chmod(0o644)  # compose mounts file secrets as they are: uid 10001 must read them
    override = yaml.safe_load((REPO / "docker-compose.tls.yml").read_text())
    for secret in override["secrets"].values():
        secret["file"] = str(directory / Path(secret["file"]).name)
    override_file = directory / "docker-compose.tls.yml"
    override_file.write_text(yaml.safe_dump(override))
    compose = Compose(project=f"lorastream-tls-{os.getpid()}", ports=Ports.free(),
                      files=[*COMPOSE_FILES, override_file])
    try:
        compose.run("build", "tokens", "minio", timeout=3600)
        compose.run("up", "-d", "--no-build", "--wait", "--wait-timeout", str(UP_TIMEOUT_S),
                    timeout=UP_TIMEOUT_S + 120)
        yield compose, directory
    finally:
        compose.run("down", "-v", "--remove-orphans", "--timeout", "60", check=False)
        assert compose.leftovers() == {"containers": [], "networks": [], "volumes": []}


def test_the_gateway_answers_https_and_a_chat_crosses_every_tls_hop(
    tls_stack: tuple[Compose, Path],
) -> None:
    compose, certs = tls_stack
    context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    base = f"https://127.0.0.1:{compose.ports.gateway}"
    with urllib.request.urlopen(f"{base}/health", context=context, timeout=30) as response:
        assert response.status == 200
    request = urllib.request.Request(
        f"{base}/v1/chat/completions", method="POST",
        headers={"Content-Type": "application/json"},
        data=b'{"model": "default", "max_tokens": 16, "temperature": 0, "messages": '
             b'[{"role": "user", "content": "What is the capital of France?"}]}')
    with urllib.request.urlopen(request, context=context, timeout=300) as response:
        body = response.read().decode()
    assert "Paris" in body, body


def test_plaintext_clients_are_refused(tls_stack: tuple[Compose, Path]) -> None:
    compose, _ = tls_stack
    with pytest.raises((OSError, http.client.HTTPException)):  # URLError, a reset, a bad line
        urllib.request.urlopen(f"http://127.0.0.1:{compose.ports.gateway}/health", timeout=30)
    with grpc.insecure_channel(f"127.0.0.1:{compose.ports.store}") as channel:
        with pytest.raises(grpc.RpcError) as refused:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
