"""docker-compose.yml and docker/Dockerfile, checked without a Docker engine.

The compose file is validated against the Compose Specification's JSON schema, vendored as
``docker/compose-spec.json`` (compose-spec/compose-spec ``schema/compose-spec.json``, as shipped in
check-jsonschema 0.39.0; Apache-2.0, license beside it). On top of the schema, the tests check what
the schema cannot: health checks, ``depends_on`` conditions, shared credentials, named volumes, and
that the commands the containers run are real ``lorastream`` commands that yield the intended
settings. ``${VAR:-default}`` interpolation is applied as compose applies it.
"""

from __future__ import annotations

import copy
import fnmatch
import functools
import hashlib
import json
import re
import socket
import stat
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft202012Validator
from typer.testing import CliRunner

from lorastream.cli.main import app
from lorastream.store.config import StoreSettings
from lorastream.store.server import create_server

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
HEALTHCHECK_SCRIPT = ROOT / "docker" / "healthcheck.py"
SCHEMA_FILE = ROOT / "docker" / "compose-spec.json"
SCHEMA_SHA256 = "d549057ebc2925f39f62799eab0db7b9e2c18b35b6c00595199116da3ed10e64"

# ${NAME}, ${NAME:-default}, ${NAME-default}, $NAME and the $$ escape: the forms the file may use.
_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)"
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?-)(?P<default>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


# -- helpers ---------------------------------------------------------------------------------------
def interpolate(value: Any, env: dict[str, str]) -> Any:
    """``value`` with compose's variable substitution applied to every string in it."""
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        name = match["braced"] or match["bare"]
        if match["op"] == ":-":
            return env.get(name) or match["default"]
        if match["op"] == "-":
            return env.get(name, match["default"])
        return env.get(name, "")

    result = _VARIABLE.sub(substitute, value)
    leftover = _VARIABLE.sub("", value)
    if "${" in leftover:
        raise ValueError(f"unsupported interpolation form in {value!r}")
    return result


def load_compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    """docker-compose.yml as compose sees it: anchors and merge keys resolved, then interpolated."""
    return interpolate(yaml.safe_load(COMPOSE_FILE.read_text()), env or {})


def schema_errors(document: Any) -> list[str]:
    validator = Draft202012Validator(json.loads(SCHEMA_FILE.read_text()))
    return [
        f"{'.'.join(map(str, error.absolute_path)) or '<root>'}: {error.message}"
        for error in validator.iter_errors(document)
    ]


def dockerfile_instructions(dockerfile: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, with continuation lines joined and comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in dockerfile.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        keyword, _, arguments = (pending + stripped).partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
        pending = ""
    return instructions


def dockerfile_json(keyword: str, dockerfile: Path = DOCKERFILE) -> list[str]:
    """The exec-form (JSON array) arguments of the last ``keyword`` instruction."""
    values = [args for kw, args in dockerfile_instructions(dockerfile) if kw == keyword]
    assert values, f"the Dockerfile has no {keyword}"
    return json.loads(values[-1])


def run_cli_capturing_settings(
    args: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> StoreSettings:
    """Run ``lorastream *args`` with ``env``, stopping where the store would start serving."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    captured: list[StoreSettings] = []
    monkeypatch.setattr("lorastream.store.server.serve", captured.append)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert len(captured) == 1, f"`lorastream {' '.join(args)}` did not start the store"
    return captured[0]


TOKENS_DIR = "/run/lorastream/tokens"  # the `tokens` volume, as every lorastream service mounts it


def run_tokens_service(directory: Path) -> None:
    """Run the compose ``tokens`` service's script with its volume at ``directory``. Its last line
    (chown to the services' uid) is left out: the tests need not run as root."""
    script = load_compose()["services"]["tokens"]["command"][0].replace(TOKENS_DIR, str(directory))
    lines = [line for line in script.splitlines() if not line.strip().startswith("chown ")]
    path = f"{Path(sys.executable).parent}:/usr/bin:/bin"
    subprocess.run(["/bin/sh", "-ec", "\n".join(lines)], env={"PATH": path}, check=True, timeout=60)


@functools.cache
def tokens_volume() -> Path:
    """A folder holding what the ``tokens`` service writes on the first start."""
    directory = Path(tempfile.mkdtemp(prefix="compose-tokens-"))
    run_tokens_service(directory)
    return directory


def service_env(service: dict[str, Any]) -> dict[str, str]:
    """The service's environment; paths into the ``tokens`` volume point at :func:`tokens_volume`
    (the tokens generated on the first start)."""
    environment = service.get("environment", {})
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) for item in environment)
    return {
        key: str(value).replace(TOKENS_DIR, str(tokens_volume()))
        for key, value in environment.items()
    }


# -- the compose file against the Compose Specification -------------------------------------------
def test_vendored_schema_is_the_pinned_compose_spec() -> None:
    assert hashlib.sha256(SCHEMA_FILE.read_bytes()).hexdigest() == SCHEMA_SHA256, (
        "docker/compose-spec.json changed: vendor a new schema on purpose and update SCHEMA_SHA256"
    )
    schema = json.loads(SCHEMA_FILE.read_text())
    Draft202012Validator.check_schema(schema)
    assert schema["title"] == "Compose Specification"


@pytest.mark.parametrize(
    "env",
    [{}, {"LORASTREAM_S3_ACCESS_KEY": "operator", "LORASTREAM_STORE_PORT": "6000"}],
    ids=["defaults", "overridden"],
)
def test_compose_file_validates_against_the_compose_spec(env: dict[str, str]) -> None:
    assert schema_errors(load_compose(env)) == []


def _rename_key(doc: dict[str, Any]) -> None:
    store = doc["services"]["adapter-store"]
    store["healthckeck"] = store.pop("healthcheck")


def _unknown_condition(doc: dict[str, Any]) -> None:
    doc["services"]["adapter-store"]["depends_on"]["minio-init"]["condition"] = "service_done"


def _ports_as_mapping(doc: dict[str, Any]) -> None:
    doc["services"]["minio"]["ports"] = {"9000": 9000}


def _services_as_list(doc: dict[str, Any]) -> None:
    doc["services"] = list(doc["services"].values())


def _healthcheck_with_bad_field(doc: dict[str, Any]) -> None:
    doc["services"]["minio"]["healthcheck"]["retry"] = 3


def _bad_service_name(doc: dict[str, Any]) -> None:
    doc["services"]["adapter store"] = doc["services"].pop("adapter-store")


@pytest.mark.parametrize(
    "breakage",
    [
        _rename_key,
        _unknown_condition,
        _ports_as_mapping,
        _services_as_list,
        _healthcheck_with_bad_field,
        _bad_service_name,
    ],
)
def test_broken_compose_documents_fail_validation(breakage: Any) -> None:
    document = copy.deepcopy(load_compose())
    breakage(document)
    assert schema_errors(document), f"{breakage.__name__} was not caught by the schema"


# -- what the schema cannot see ------------------------------------------------------------------
def _one_shot(service: dict[str, Any]) -> bool:
    return service.get("restart") == "no"


def test_every_long_running_service_has_a_healthcheck() -> None:
    services = load_compose()["services"]
    for name, service in services.items():
        if _one_shot(service):
            continue
        check = service.get("healthcheck")
        assert check, f"{name} has no healthcheck"
        assert not check.get("disable"), f"{name} disables its healthcheck"
        assert check["test"][0] in ("CMD", "CMD-SHELL") and len(check["test"]) > 1, name


def test_one_shot_services_are_awaited_until_they_complete() -> None:
    services = load_compose()["services"]
    one_shots = {name for name, service in services.items() if _one_shot(service)}
    assert one_shots == {"minio-init", "tokens"}
    for name, service in services.items():
        for dependency, spec in service.get("depends_on", {}).items():
            if dependency in one_shots:
                assert spec["condition"] == "service_completed_successfully", (name, dependency)


@pytest.mark.parametrize(
    ("service", "dependency", "condition"),
    [
        ("minio-init", "minio", "service_healthy"),
        ("adapter-store", "minio", "service_healthy"),
        ("adapter-store", "minio-init", "service_completed_successfully"),
        ("adapter-store", "tokens", "service_completed_successfully"),
        ("gpu-worker-cpu", "tokens", "service_completed_successfully"),
        ("gateway", "tokens", "service_completed_successfully"),
    ],
)
def test_depends_on_conditions(service: str, dependency: str, condition: str) -> None:
    services = load_compose()["services"]
    assert services[service]["depends_on"][dependency]["condition"] == condition
    if condition == "service_healthy":
        assert "healthcheck" in services[dependency], f"{dependency} cannot become healthy"


def test_depends_on_names_existing_services_without_cycles() -> None:
    services = load_compose()["services"]
    graph = {name: set(service.get("depends_on", {})) for name, service in services.items()}
    for name, dependencies in graph.items():
        unknown = dependencies - graph.keys()
        assert not unknown, f"{name} depends on unknown services {sorted(unknown)}"
    order: list[str] = []
    while graph:
        ready = sorted(name for name, deps in graph.items() if deps <= set(order))
        assert ready, f"depends_on cycle among {sorted(graph)}"
        order.extend(ready)
        for name in ready:
            del graph[name]
    assert order == [
        "minio", "tokens", "minio-init", "adapter-store", "gpu-worker", "gpu-worker-cpu", "gateway"
    ]


@pytest.mark.parametrize(
    "env",
    [{}, {"LORASTREAM_S3_ACCESS_KEY": "ops-user", "LORASTREAM_S3_SECRET_KEY": "a-long-secret-1"}],
    ids=["defaults", "overridden"],
)
def test_store_reads_the_credentials_minio_was_started_with(env: dict[str, str]) -> None:
    services = load_compose(env)["services"]
    minio, init, store = (
        service_env(services[name]) for name in ("minio", "minio-init", "adapter-store")
    )
    for aws, minio_name in (
        ("AWS_ACCESS_KEY_ID", "MINIO_ROOT_USER"), ("AWS_SECRET_ACCESS_KEY", "MINIO_ROOT_PASSWORD")
    ):
        assert store[aws] == minio[minio_name] == init[minio_name], aws
    assert len(minio["MINIO_ROOT_PASSWORD"]) >= 8, "MinIO refuses root passwords under 8 characters"
    for name, value in env.items():
        assert value in (store["AWS_ACCESS_KEY_ID"], store["AWS_SECRET_ACCESS_KEY"]), name
    assert store["AWS_ENDPOINT_URL"] == "http://minio:9000"
    script = " ".join(services["minio-init"]["command"])
    assert '"$MINIO_ROOT_USER" "$MINIO_ROOT_PASSWORD"' in script  # $$ escapes compose's expansion
    assert "mc mb --ignore-existing local/adapters" in script


def test_named_volumes_are_declared_and_hold_the_store_cache() -> None:
    compose = load_compose()
    declared = set(compose.get("volumes", {}))
    mounts: dict[str, str] = {}
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            if not source.startswith((".", "/")):
                assert source in declared, f"{name} mounts undeclared volume {source}"
                mounts[source] = target
    assert mounts == {
        "minio-data": "/data",
        "adapter-store-cache": "/var/lib/lorastream/store",
        "worker-models": "/var/lib/lorastream/models",
        "tokens": TOKENS_DIR,
    }
    command = compose["services"]["adapter-store"]["command"]
    assert command[command.index("--cache-dir") + 1] == mounts["adapter-store-cache"]


# -- the commands the containers run -------------------------------------------------------------
def test_dockerfile_entrypoint_is_the_lorastream_cli() -> None:
    assert dockerfile_json("ENTRYPOINT") == ["lorastream"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["lorastream"] == "lorastream.cli.main:app"


@pytest.mark.parametrize(
    ("env", "cache_bytes"),
    [({}, 20 << 30), ({"LORASTREAM_STORE_CACHE_BYTES": str(3 << 30)}, 3 << 30)],
    ids=["default-budget", "budget-from-env"],
)
def test_compose_command_starts_the_store_with_the_compose_settings(
    env: dict[str, str], cache_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = load_compose(env)["services"]["adapter-store"]
    assert "entrypoint" not in store, "the image's ENTRYPOINT (lorastream) must stay in effect"
    settings = run_cli_capturing_settings(
        [str(arg) for arg in store["command"]],
        service_env(store) | {"LORASTREAM_TOKEN": "op-token"},
        monkeypatch,
    )
    assert (settings.host, settings.port) == ("0.0.0.0", 50051)
    assert settings.cache_dir == Path("/var/lib/lorastream/store")
    assert settings.cache_bytes == cache_bytes
    assert settings.s3_endpoint_url == "http://minio:9000"
    assert settings.hf_endpoint == "https://huggingface.co"
    assert settings.token == "op-token"


def test_dockerfile_default_command_starts_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = run_cli_capturing_settings(dockerfile_json("CMD"), {}, monkeypatch)
    assert (settings.host, settings.port) == ("0.0.0.0", 50051)
    assert settings.cache_dir == Path("/var/lib/lorastream/store")


def test_store_serve_help_lists_the_flags_compose_passes() -> None:
    result = CliRunner().invoke(app, ["store", "serve", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    offered = set(re.findall(r"--[a-z][a-z-]*", result.output))
    command = load_compose()["services"]["adapter-store"]["command"]
    for flag in (arg for arg in command if str(arg).startswith("--")):
        assert flag in offered, f"`lorastream store serve` has no {flag}"


# -- the image -------------------------------------------------------------------------------------
def test_dockerfile_runs_as_a_non_root_user_from_python_311_slim() -> None:
    instructions = dockerfile_instructions()
    args = dict(
        arg.split("=", 1) for kw, arg in instructions if kw == "ARG" and "=" in arg
    )
    bases = [arg.split()[0].replace("${PYTHON_IMAGE}", args["PYTHON_IMAGE"])
             for kw, arg in instructions if kw == "FROM"]
    assert bases and all(base == "python:3.11-slim" for base in bases)
    users = [arg for kw, arg in instructions if kw == "USER"]
    assert users and users[-1] not in ("root", "0")


def test_dockerfile_installs_the_runtime_lock_and_cpu_torch() -> None:
    runs = " ".join(arg for kw, arg in dockerfile_instructions() if kw == "RUN")
    assert "--requirement requirements.lock" in runs
    assert all("requirements-dev.lock" not in arg for _, arg in dockerfile_instructions())
    args = dict(
        arg.split("=", 1) for kw, arg in dockerfile_instructions() if kw == "ARG" and "=" in arg
    )
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert '${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"}' in runs
    assert "--find-links /opt/build-extras/wheels" in runs
    assert "assert torch.version.cuda is None" in runs  # the CUDA build fails the build
    assert "pip install --no-deps ." in runs


def test_store_healthcheck_runs_the_script_the_image_ships() -> None:
    test = load_compose()["services"]["adapter-store"]["healthcheck"]["test"]
    assert test[:2] == ["CMD", "/opt/venv/bin/python"]
    copies = [arg.split() for kw, arg in dockerfile_instructions() if kw == "COPY"]
    assert ["docker/healthcheck.py", test[2]] in copies
    runs = [arg for kw, arg in dockerfile_instructions() if kw == "RUN"]
    assert any("python -m venv /opt/venv" in run for run in runs)


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore excludes ``path`` (its patterns, in order; ``!`` re-includes)."""
    excluded = False
    parts = path.split("/")
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        for depth in range(1, len(parts) + 1):
            prefix = "/".join(parts[:depth])
            if fnmatch.fnmatch(prefix, pattern) or (
                pattern.startswith("**/") and fnmatch.fnmatch(parts[depth - 1], pattern[3:])
            ):
                excluded = not negate
                break
    return excluded


def test_build_context_keeps_what_the_dockerfile_copies_and_drops_the_venv() -> None:
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    args = dict(
        arg.split("=", 1) for kw, arg in dockerfile_instructions() if kw == "ARG" and "=" in arg
    )
    for keyword, arguments in dockerfile_instructions():
        if keyword != "COPY" or arguments.startswith("--from"):
            continue
        for source in arguments.split()[:-1]:
            source = re.sub(r"\$\{(\w+)\}", lambda match: args[match[1]], source)
            assert (ROOT / source).exists(), f"COPY {source}: no such file in the repository"
            assert not _ignored(source, patterns), f"COPY {source}: excluded by .dockerignore"
    for path in (".venv/bin/python", ".git/HEAD", "lorastream/__pycache__/x.pyc", "tests/x.py"):
        assert _ignored(path, patterns), f"{path} would be sent to the Docker daemon"


# -- the health check script -----------------------------------------------------------------------
def _healthcheck(target: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(HEALTHCHECK_SCRIPT), target, "--timeout", "2"],
        capture_output=True, text=True, timeout=30, check=False,
    )


def test_healthcheck_script_passes_on_a_serving_store(tmp_path: Path) -> None:
    server, port, _ = create_server(StoreSettings(port=0, cache_dir=tmp_path / "cache"))
    server.start()
    try:
        result = _healthcheck(f"127.0.0.1:{port}")
    finally:
        server.stop(None).wait()
    assert result.returncode == 0, result.stderr
    assert "SERVING" in result.stderr


def test_healthcheck_script_fails_when_nothing_listens() -> None:
    with socket.socket() as probe:  # a port that was just free: nothing listens there now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = _healthcheck(f"127.0.0.1:{port}")
    assert result.returncode == 1
    assert "UNAVAILABLE" in result.stderr or "DEADLINE_EXCEEDED" in result.stderr


def test_every_service_has_the_tokens_that_let_it_start_on_0_0_0_0_and_talk_to_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lorastream.gateway.config import GatewaySettings
    from lorastream.worker.service.config import WorkerSettings

    services = load_compose({})["services"]

    def settings(service: str, cls: type) -> Any:
        with monkeypatch.context() as patch:
            for name, value in service_env(services[service]).items():
                patch.setenv(name, value)
            return cls(workers=["gpu-worker:50052"]) if cls is GatewaySettings else cls()

    store = settings("adapter-store", StoreSettings)
    worker = settings("gpu-worker-cpu", WorkerSettings)
    gateway = settings("gateway", GatewaySettings)
    assert store.access_tokens().operate and store.access_tokens().read
    assert worker.store_token == store.access_tokens().read  # workers read with the read token
    assert worker.access_tokens().operate == gateway.effective_worker_token
    assert gateway.token and gateway.effective_store_token == store.access_tokens().operate


def test_no_token_has_a_default_in_the_compose_file() -> None:
    """A copied compose file is never open with a publicly known token: every token variable is
    empty unless the operator sets it, and then the generated token files are read."""
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    for name, service in raw["services"].items():
        for variable, value in service_env(service).items():
            if variable.endswith("TOKEN") and variable != "HF_TOKEN":
                assert value in (f"${{{variable}:-}}", ""), (name, variable, value)
    for name, service in load_compose()["services"].items():
        env = service_env(service)
        for variable, value in env.items():
            if variable.endswith("_TOKEN_FILE"):
                assert value.startswith(str(tokens_volume())), (name, variable, value)


def test_the_tokens_service_generates_random_tokens_once(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    for directory in (first, second):
        directory.mkdir()
        run_tokens_service(directory)
    names = {"operate-token", "read-token"}
    assert {path.name for path in first.iterdir()} == names
    tokens = {name: (first / name).read_text().strip() for name in names}
    assert all(len(token) >= 32 for token in tokens.values())
    assert tokens["operate-token"] != tokens["read-token"]
    for name in names:
        assert (second / name).read_text().strip() != tokens[name], "a token is not random"
        assert stat.S_IMODE((first / name).stat().st_mode) == 0o600, name
    run_tokens_service(first)  # the next start keeps them
    assert {name: (first / name).read_text().strip() for name in names} == tokens


# -- docker-compose.tls.yml: TLS on every hop ----------------------------------------------------
TLS_OVERRIDE = ROOT / "docker-compose.tls.yml"


def test_the_tls_override_validates_and_mounts_the_files_the_generator_writes(
    tmp_path: Path,
) -> None:
    from lorastream.stack.certs import make_local_certs

    override = yaml.safe_load(TLS_OVERRIDE.read_text())
    assert schema_errors(override) == []
    certs = make_local_certs(tmp_path)
    written = {getattr(certs, f).name for f in certs.__dataclass_fields__}
    assert {Path(s["file"]).name for s in override["secrets"].values()} == written
    base = load_compose()["services"]
    for name, service in override["services"].items():
        assert name in base, f"{name}: the override names no service of docker-compose.yml"
        mounted = {f"/run/secrets/{secret}" for secret in service["secrets"]}
        paths = {v for k, v in service["environment"].items() if "_TLS_" in k}
        assert paths and paths <= mounted, name
        assert "--tls-ca" in service["healthcheck"]["test"], name


@pytest.mark.parametrize(
    ("service", "settings", "fields"),
    [
        ("adapter-store", "lorastream.store.config.StoreSettings",
         ["tls_cert", "tls_key", "tls_client_ca"]),
        ("gpu-worker", "lorastream.worker.service.config.WorkerSettings",
         ["tls_cert", "tls_key", "tls_client_ca", "store_tls_ca", "store_tls_client_cert",
          "store_tls_client_key"]),
        ("gateway", "lorastream.gateway.config.GatewaySettings",
         ["tls_cert", "tls_key", "worker_tls_ca", "worker_tls_client_cert",
          "worker_tls_client_key", "store_tls_ca", "store_tls_client_cert",
          "store_tls_client_key"]),
    ],
)
def test_the_tls_override_sets_every_tls_setting_of_each_service(
    service: str, settings: str, fields: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib

    module, _, name = settings.rpartition(".")
    environment = service_env(yaml.safe_load(TLS_OVERRIDE.read_text())["services"][service])
    for variable, value in environment.items():
        monkeypatch.setenv(variable, value)
    loaded = getattr(importlib.import_module(module), name)()
    for field in fields:
        assert str(getattr(loaded, field)).startswith("/run/secrets/tls-"), field


# -- graceful stop ---------------------------------------------------------------------------------
STOP_MARGIN_S = 10  # what a drained server gets to stop before docker kills it
DRAINING = {  # service -> the function its command reaches, the variable of its drain
    "gateway": ("lorastream.gateway.server.serve", "LORASTREAM_GATEWAY_DRAIN_SECONDS"),
    "gpu-worker-cpu": ("lorastream.worker.service.server.serve", "LORASTREAM_WORKER_DRAIN_SECONDS"),
}


def _seconds(duration: str) -> float:
    """A compose duration such as ``40s``, ``1m30s``."""
    units = {"h": 3600, "m": 60, "s": 1}
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", duration)
    assert "".join(f"{n}{u}" for n, u in parts) == duration, f"unsupported duration {duration!r}"
    return sum(float(n) * units[u] for n, u in parts)


@pytest.mark.parametrize("service", list(DRAINING))
@pytest.mark.parametrize("drain", [None, "60"], ids=["as-composed", "drain-raised-to-60s"])
def test_stop_grace_period_covers_the_drain_and_a_margin(
    service: str, drain: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.deploy.test_compose_stack import run_capturing

    config = load_compose()["services"][service]
    serve, variable = DRAINING[service]
    env = service_env(config) | {"LORASTREAM_TOKEN": "op-token"}
    if drain is not None:  # a drain the grace period does not cover must be caught
        env[variable] = drain
    settings = run_capturing(config["command"], env, serve, monkeypatch)
    covered = _seconds(config["stop_grace_period"]) >= settings.drain_seconds + STOP_MARGIN_S
    assert covered is (drain is None), (service, config["stop_grace_period"], settings)


# -- metrics ---------------------------------------------------------------------------------------
METRICS = {  # service -> the function its command reaches, the port its metrics are served on
    "adapter-store": ("lorastream.store.server.serve", 9451),
    "gpu-worker": ("lorastream.worker.service.server.serve", 9452),
    "gpu-worker-cpu": ("lorastream.worker.service.server.serve", 9452),
}


@pytest.mark.parametrize("service", list(METRICS))
def test_the_store_and_the_workers_serve_metrics_on_a_port_published_on_loopback(
    service: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.deploy.test_compose_stack import run_capturing

    config = load_compose()["services"][service]
    serve, port = METRICS[service]
    env = service_env(config) | {"LORASTREAM_TOKEN": "op-token"}
    settings = run_capturing(config["command"], env, serve, monkeypatch)
    assert (settings.host, settings.metrics_port) == ("0.0.0.0", port)
    assert f"127.0.0.1:{port}:{port}" in config["ports"]


@pytest.mark.parametrize(
    ("env", "published"),
    [({}, "127.0.0.1:9452:9452"),
     ({"LORASTREAM_WORKER_METRICS_PORT": "19452"}, "127.0.0.1:19452:9452")],
    ids=["default", "moved-on-the-host"],
)
def test_the_published_metrics_port_moves_on_the_host_only(
    env: dict[str, str], published: str
) -> None:
    from tests.deploy.test_compose_stack import option

    worker = load_compose(env)["services"]["gpu-worker-cpu"]
    assert published in worker["ports"]
    assert option(worker["command"], "--metrics-port") == "9452"
