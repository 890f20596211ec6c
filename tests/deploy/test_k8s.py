"""deploy/k8s/, checked without a cluster.

Every manifest is validated against the strict Kubernetes v1.30 JSON schemas vendored in
``deploy/k8s/schemas/`` (from the kubernetes-validate 1.37.0 wheel; Apache-2.0; sha256-pinned
here), offline, with ``jsonschema``. On top of the schema, the tests check what it cannot: the
kustomization lists every manifest, selectors match pod labels, Services target ports their pods
declare, probes ask the ports the servers listen on, the worker asks for a GPU, the gateway finds
the workers through their headless Service, the pods meet the ``restricted`` Pod Security profile,
every env reference resolves, and the container args are real ``lorastream`` commands that yield
the intended settings. Broken documents must fail the same checks.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import subprocess
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft202012Validator
from referencing import Registry, Resource

from tests.deploy.test_compose_stack import option, run_capturing

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
SCHEMAS = K8S / "schemas"
NAMESPACE = "lorastream"
IMAGE_UID = 10001  # USER 10001:10001 in docker/Dockerfile and docker/Dockerfile.cuda
SCHEMA_SHA256 = {
    "_definitions.json": "085f08b0ff79c9128eba701ec7a9c802749dd767e53501c4251d02fdddb5eb08",
    "configmap-v1.json": "9062084aebe09d7e2114a8d10116155d73516751f3f6cd874480c4826709ae3c",
    "deployment-apps-v1.json": "dc3e2e5f811d9e4d848ec6e9f6e6363b75b4c29f83e16910dd7d9f4dc1302689",
    "ingress-networking-v1.json":
        "c7d1d6184a9b3597b9f3d52413f8e322b4c8b1c48e77c98b3845c8db02c03315",
    "namespace-v1.json": "e65a7d94a74f8c5eabdddaeb66a5e1d9fd87de27f358d8904d90970cc014d3ae",
    "secret-v1.json": "2b932622eae80cd223d7f4d66519c8f9f9b1a8299c63a5906a83cf88509f1869",
    "service-v1.json": "f4b44f2cc602e3b3f55a40c96d38d2f8d0fbecdde30d799d7138ad9d9de85593",
    "statefulset-apps-v1.json": "dca4f45f59aae85596fd730a8069f78d4f4ccbc6ff23f599f50c33189759463a",
}
SERVES = {  # workload -> the function its container args must reach
    "adapter-store": "lorastream.store.server.serve",
    "gpu-worker": "lorastream.worker.service.server.serve",
    "gateway": "lorastream.gateway.server.serve",
}


# -- loading ---------------------------------------------------------------------------------------
def kustomization() -> dict[str, Any]:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def base() -> list[dict[str, Any]]:
    """What `kubectl apply -k deploy/k8s` applies (fresh copies)."""
    return [doc for name in kustomization()["resources"] for doc in load(K8S / name)]


def extras() -> list[dict[str, Any]]:
    return [doc for path in sorted((K8S / "extras").glob("*.yaml")) for doc in load(path)]


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]


def workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def the_container(workload: dict[str, Any]) -> dict[str, Any]:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def ident(doc: dict[str, Any]) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


# -- schema validation -----------------------------------------------------------------------------
@functools.cache
def _validator(schema_file: str) -> Draft202012Validator:
    definitions = Resource.from_contents(json.loads((SCHEMAS / "_definitions.json").read_text()))
    schema = json.loads((SCHEMAS / schema_file).read_text())
    registry = Registry().with_resources([(definitions.id(), definitions)])
    return Draft202012Validator(schema, registry=registry)


def schema_errors(doc: dict[str, Any]) -> list[str]:
    group_version = doc.get("apiVersion", "")
    group, _, version = group_version.rpartition("/")
    name = f"{doc.get('kind', '').lower()}-{group.split('.')[0] + '-' if group else ''}{version}"
    if not (SCHEMAS / f"{name}.json").is_file():
        return [f"no vendored schema for {doc.get('kind')} {group_version}"]
    return [
        f"{'.'.join(map(str, error.absolute_path)) or '<root>'}: {error.message}"
        for error in _validator(f"{name}.json").iter_errors(doc)
    ]


def test_vendored_schemas_are_the_pinned_files() -> None:
    present = {path.name for path in SCHEMAS.glob("*.json")}
    assert present == set(SCHEMA_SHA256)
    for name, digest in SCHEMA_SHA256.items():
        assert hashlib.sha256((SCHEMAS / name).read_bytes()).hexdigest() == digest, (
            f"{name} changed: vendor new schemas on purpose and update SCHEMA_SHA256"
        )
    assert (SCHEMAS / "LICENSE").is_file() and (SCHEMAS / "README.md").is_file()


@pytest.mark.parametrize("doc", base() + extras(), ids=ident)
def test_manifest_validates_against_the_kubernetes_schema(doc: dict[str, Any]) -> None:
    assert schema_errors(doc) == []


def _container(doc: dict[str, Any]) -> dict[str, Any]:
    return the_container(doc)


BREAKAGES: list[tuple[str, str, Callable[[dict[str, Any]], Any]]] = [
    ("Deployment/gateway", "misspelled-field",
     lambda d: _container(d)["securityContext"].update(readOnlyRootFilesystm=True)),
    ("Deployment/gpu-worker", "replicas-as-word", lambda d: d["spec"].update(replicas="two")),
    ("Deployment/gpu-worker", "grpc-probe-with-named-port",
     lambda d: _container(d)["readinessProbe"]["grpc"].update(port="grpc")),
    ("Deployment/gpu-worker", "gpu-limit-as-list",
     lambda d: _container(d)["resources"]["limits"].update({"nvidia.com/gpu": [1]})),
    ("StatefulSet/adapter-store", "env-without-name",
     lambda d: _container(d)["env"][0].pop("name")),
    ("StatefulSet/adapter-store", "args-as-string",
     lambda d: _container(d).update(args="store serve")),
    ("Service/gateway", "port-without-number", lambda d: d["spec"]["ports"][0].pop("port")),
    ("Deployment/gateway", "removed-api-version",
     lambda d: d.update(apiVersion="extensions/v1beta1")),
    ("Namespace/lorastream", "labels-as-list", lambda d: d["metadata"].update(labels=["a"])),
]


@pytest.mark.parametrize(("target", "breakage"), [(t, b) for t, _, b in BREAKAGES],
                         ids=[name for _, name, _ in BREAKAGES])
def test_broken_manifests_fail_schema_validation(target: str, breakage: Callable) -> None:
    (doc,) = [d for d in base() if ident(d) == target]
    breakage(doc)
    assert schema_errors(doc)


# -- the kustomization -----------------------------------------------------------------------------
def test_kustomization_lists_every_manifest_and_pins_the_images() -> None:
    config = kustomization()
    files = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(config["resources"]) == files
    assert config["namespace"] == NAMESPACE
    assert [ns["metadata"]["name"] for ns in find(base(), "Namespace")] == [NAMESPACE]
    for doc in base() + extras():
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == NAMESPACE, ident(doc)
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    images = {image["name"]: image for image in config["images"]}
    for workload in workloads(base()):
        name, tag = the_container(workload)["image"].split(":")
        assert images[name]["newTag"] == tag == version, ident(workload)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (its kustomize) not installed")
def test_kustomize_renders_the_manifests_unchanged() -> None:
    rendered = subprocess.run(
        ["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    key = ident
    assert sorted(yaml.safe_load_all(rendered), key=key) == sorted(base(), key=key)


# -- what the schema cannot see: semantic checks, each returning its problems ---------------------
def selector_problems(docs: list[dict[str, Any]]) -> list[str]:
    problems = []
    for workload in workloads(docs):
        selector = workload["spec"]["selector"]["matchLabels"]
        labels = workload["spec"]["template"]["metadata"]["labels"]
        if not selector.items() <= labels.items():
            problems.append(f"{ident(workload)}: selector {selector} misses pod labels {labels}")
    return problems


def service_problems(docs: list[dict[str, Any]]) -> list[str]:
    problems = []
    for service in find(docs, "Service"):
        selector = service["spec"]["selector"].items()
        pods = [w for w in workloads(docs)
                if selector <= w["spec"]["template"]["metadata"]["labels"].items()]
        if len(pods) != 1:
            problems.append(f"{ident(service)} selects {len(pods)} workloads")
            continue
        declared = {(p.get("name"), p["containerPort"]) for p in the_container(pods[0])["ports"]}
        for port in service["spec"]["ports"]:
            if not any(port["targetPort"] in pair for pair in declared):
                problems.append(f"{ident(service)}: targetPort {port['targetPort']} not declared")
    return problems


def probe_problems(docs: list[dict[str, Any]]) -> list[str]:
    """Every probe asks the port given to the server's --port, by number or by port name."""
    problems = []
    for workload in workloads(docs):
        container = the_container(workload)
        serving = int(option(container["args"], "--port"))
        names = {p["name"]: p["containerPort"] for p in container["ports"]}
        if serving not in names.values():
            problems.append(f"{ident(workload)}: --port {serving} is not a containerPort")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            for action in container.get(probe, {}).values():
                if isinstance(action, dict) and "port" in action:
                    port = names.get(action["port"], action["port"])
                    if port != serving:
                        problems.append(f"{ident(workload)}: {probe} asks {port}, not {serving}")
    return problems


def check(docs: list[dict[str, Any]]) -> list[str]:
    return selector_problems(docs) + service_problems(docs) + probe_problems(docs)


def test_selectors_services_and_probes_fit_together() -> None:
    assert check(base()) == []


def _by(docs: list[dict[str, Any]], target: str) -> dict[str, Any]:
    return next(d for d in docs if ident(d) == target)


def _set_option(args: list[str], flag: str, value: str) -> None:
    args[args.index(flag) + 1] = value


SEMANTIC_BREAKAGES: list[tuple[str, Callable[[list[dict[str, Any]]], Any]]] = [
    ("selector-misses-pod-labels", lambda docs: _by(docs, "Deployment/gateway")["spec"]["selector"]
     ["matchLabels"].update({"app.kubernetes.io/name": "gatway"})),
    ("service-selects-nothing", lambda docs: _by(docs, "Service/gpu-worker")["spec"]["selector"]
     .update({"app.kubernetes.io/name": "worker"})),
    ("service-targets-undeclared-port",
     lambda docs: _by(docs, "Service/adapter-store")["spec"]["ports"][0].update(targetPort="http")),
    ("probe-on-another-port", lambda docs: _container(_by(docs, "Deployment/gpu-worker"))
     ["livenessProbe"]["grpc"].update(port=50051)),
    ("server-on-another-port", lambda docs: _set_option(
        _container(_by(docs, "Deployment/gateway"))["args"], "--port", "8080")),
]


@pytest.mark.parametrize("breakage", [b for _, b in SEMANTIC_BREAKAGES],
                         ids=[name for name, _ in SEMANTIC_BREAKAGES])
def test_broken_wiring_is_caught(breakage: Callable[[list[dict[str, Any]]], Any]) -> None:
    docs = base()
    breakage(docs)
    assert check(docs)


def test_gpu_worker_asks_for_one_gpu_and_nothing_else_does() -> None:
    for workload in workloads(base()):
        resources = the_container(workload)["resources"]
        gpus = resources["limits"].get("nvidia.com/gpu")
        assert resources["requests"].get("nvidia.com/gpu", gpus) == gpus
        if workload["metadata"]["name"] == "gpu-worker":
            assert gpus == 1
            assert the_container(workload)["image"].startswith("lorastream-cuda:")
            assert all("grpc" in the_container(workload)[p] for p in
                       ("startupProbe", "readinessProbe", "livenessProbe"))
        else:
            assert gpus is None, ident(workload)


def test_gateway_finds_workers_and_store_through_their_services() -> None:
    docs = base()
    args = the_container(_by(docs, "Deployment/gateway"))["args"]
    host, port = option(args, "--worker").split(":")
    workers = _by(docs, f"Service/{host}")["spec"]
    assert workers["clusterIP"] == "None", "one DNS record per worker pod needs a headless Service"
    assert workers.get("publishNotReadyAddresses", False) is False
    worker_pods = _by(docs, "Deployment/gpu-worker")["spec"]["selector"]["matchLabels"]
    assert workers["selector"] == worker_pods
    assert {p["name"]: p["port"] for p in workers["ports"]}["grpc"] == int(port)
    for workload in ("Deployment/gateway", "Deployment/gpu-worker"):
        args = the_container(_by(docs, workload))["args"]
        store_host, store_port = option(args, "--store").split(":")
        store = _by(docs, f"Service/{store_host}")["spec"]
        assert {p["name"]: p["port"] for p in store["ports"]}["grpc"] == int(store_port)
    assert _by(docs, "StatefulSet/adapter-store")["spec"]["serviceName"] == "adapter-store"


def test_ingress_routes_to_the_gateway_service() -> None:
    (ingress,) = find(extras(), "Ingress")
    (path,) = ingress["spec"]["rules"][0]["http"]["paths"]
    service = _by(base(), f"Service/{path['backend']['service']['name']}")
    port_names = {p["name"] for p in service["spec"]["ports"]}
    assert path["backend"]["service"]["port"]["name"] in port_names


def test_pods_meet_the_restricted_pod_security_profile() -> None:
    for workload in workloads(base()):
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == IMAGE_UID
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert not any(pod.get(key) for key in ("hostNetwork", "hostPID", "hostIPC"))
        assert all("hostPath" not in volume for volume in pod.get("volumes", []))
        security = the_container(workload)["securityContext"]
        assert security["allowPrivilegeEscalation"] is False
        assert security["capabilities"]["drop"] == ["ALL"]
        assert not security.get("privileged") and "add" not in security["capabilities"]
        resources = the_container(workload)["resources"]
        assert {"cpu", "memory"} <= resources["requests"].keys(), ident(workload)
        assert "memory" in resources["limits"], ident(workload)
    (namespace,) = find(base(), "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_env_references_resolve_to_the_configmap_and_the_example_secret() -> None:
    config_maps = {d["metadata"]["name"] for d in find(base(), "ConfigMap")}
    (secret,) = find(extras(), "Secret")
    assert not find(base(), "Secret"), "no placeholder Secret may be applied by the kustomization"
    for workload in workloads(base()):
        container = the_container(workload)
        for source in container.get("envFrom", []):
            assert source["configMapRef"]["name"] in config_maps
        for variable in container.get("env", []):
            ref = variable["valueFrom"]["secretKeyRef"]
            assert ref["name"] == secret["metadata"]["name"]
            assert ref["key"] in secret["stringData"], (ident(workload), ref["key"])


# -- the container args are real commands ----------------------------------------------------------
def container_environment(workload: dict[str, Any]) -> dict[str, str]:
    """The environment Kubernetes gives the container, secrets taken from the example Secret."""
    docs = base()
    (secret,) = find(extras(), "Secret")
    container = the_container(workload)
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env |= _by(docs, f"ConfigMap/{source['configMapRef']['name']}")["data"]
    for variable in container.get("env", []):
        ref = variable["valueFrom"]["secretKeyRef"]
        value = secret["stringData"].get(ref["key"])
        if value:  # an empty or missing optional key: the variable stays unset
            env[variable["name"]] = value
    return env


def mounts(workload: dict[str, Any]) -> dict[str, Path]:
    return {m["name"]: Path(m["mountPath"]) for m in the_container(workload)["volumeMounts"]}


@pytest.mark.parametrize("name", list(SERVES))
def test_container_args_start_the_service_with_the_manifest_settings(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    (workload,) = [w for w in workloads(base()) if w["metadata"]["name"] == name]
    env = container_environment(workload)
    settings = run_capturing(the_container(workload)["args"], env, SERVES[name], monkeypatch)
    assert settings.host == "0.0.0.0"
    (secret,) = find(extras(), "Secret")
    tokens = secret["stringData"]
    if name == "adapter-store":
        assert settings.port == 50051
        (claim,) = workload["spec"]["volumeClaimTemplates"]
        assert settings.cache_dir == mounts(workload)[claim["metadata"]["name"]]
        volume_gib = int(claim["spec"]["resources"]["requests"]["storage"].removesuffix("Gi"))
        assert settings.cache_bytes == int(env["LORASTREAM_STORE_CACHE_BYTES"]) < volume_gib << 30
        assert settings.s3_endpoint_url == env["AWS_ENDPOINT_URL"]
        assert settings.token == tokens["store-token"]
        assert settings.read_token == tokens["store-read-token"]
    elif name == "gpu-worker":
        assert (settings.port, settings.device, settings.model) == (50052, "cuda", "default")
        assert settings.store == "adapter-store:50051"
        assert settings.model_cache_dir == mounts(workload)["models"]
        limit_gib = int(the_container(workload)["resources"]["limits"]["memory"].removesuffix("Gi"))
        assert settings.host_cache_bytes < limit_gib << 30
        assert settings.token == tokens["worker-token"]
        assert settings.store_token == tokens["store-read-token"]
    else:
        assert settings.port == 8000
        assert settings.workers == ["gpu-worker:50052"]
        assert settings.store == "adapter-store:50051"
        assert settings.token == tokens["gateway-token"]
        assert settings.effective_store_token == tokens["store-token"]
        assert settings.effective_worker_token == tokens["worker-token"]


def test_read_only_root_filesystem_leaves_home_and_tmp_writable() -> None:
    for workload in workloads(base()):
        assert the_container(workload)["securityContext"]["readOnlyRootFilesystem"] is True
        paths = set(mounts(workload).values())
        assert {Path("/var/lib/lorastream"), Path("/tmp")} <= paths, ident(workload)


# -- the optional TLS component (deploy/k8s/tls) ---------------------------------------------------
TLS_DIR = Path("/etc/lorastream/tls")
TLS_FIELDS = {  # workload -> settings field -> the Secret's file it must name
    "adapter-store": {"tls_cert": "tls.crt", "tls_key": "tls.key", "tls_client_ca": "ca.crt"},
    "gpu-worker": {"tls_cert": "tls.crt", "tls_key": "tls.key", "tls_client_ca": "ca.crt",
                   "store_tls_ca": "ca.crt", "store_tls_client_cert": "tls.crt",
                   "store_tls_client_key": "tls.key"},
    "gateway": {"tls_cert": "tls.crt", "tls_key": "tls.key", "worker_tls_ca": "ca.crt",
                "worker_tls_client_cert": "tls.crt", "worker_tls_client_key": "tls.key",
                "store_tls_ca": "ca.crt", "store_tls_client_cert": "tls.crt",
                "store_tls_client_key": "tls.key"},
}


@functools.cache
def _with_components(*components: str) -> str:
    """`kubectl kustomize` of deploy/k8s with these optional components enabled, as YAML text."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "k8s"
        shutil.copytree(K8S, copy, ignore=shutil.ignore_patterns("schemas"))
        with (copy / "kustomization.yaml").open("a") as file:
            file.write("components:\n" + "".join(f"  - {c}\n" for c in components))
        return subprocess.run(
            ["kubectl", "kustomize", str(copy)], capture_output=True, text=True, timeout=60,
            check=True,
        ).stdout


def _with_tls() -> str:
    """`kubectl kustomize` of deploy/k8s with the tls component enabled, as YAML text."""
    return _with_components("tls")


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (its kustomize) not installed")
@pytest.mark.parametrize("name", list(SERVES))
def test_the_tls_component_mounts_the_secret_and_points_every_tls_setting_into_it(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = list(yaml.safe_load_all(_with_tls()))
    assert [e for doc in docs for e in schema_errors(doc)] == []
    assert check(docs) == []
    (workload,) = [w for w in workloads(docs) if w["metadata"]["name"] == name]
    container = the_container(workload)
    (volume,) = [v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls"]
    assert volume["secret"]["secretName"] == "lorastream-tls"
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "tls"]
    assert (Path(mount["mountPath"]), mount["readOnly"]) == (TLS_DIR, True)
    literal = {v["name"]: v["value"] for v in container["env"] if "value" in v}
    secret_env = {v["name"]: "x" for v in container["env"] if "valueFrom" in v}
    settings = run_capturing(container["args"], {**secret_env, **literal}, SERVES[name],
                             monkeypatch)
    assert {f: getattr(settings, f) for f in TLS_FIELDS[name]} == {
        f: TLS_DIR / file for f, file in TLS_FIELDS[name].items()
    }
    probes = [container[p] for p in ("startupProbe", "readinessProbe", "livenessProbe")
              if p in container]
    for probe in probes:  # Kubernetes' own gRPC probe cannot speak TLS
        assert "grpc" not in probe
        if "exec" in probe:
            command = probe["exec"]["command"]
            assert command[1] == "/opt/lorastream/healthcheck.py"
            assert command[2] == f"localhost:{option(container['args'], '--port')}"
            assert option(command, "--tls-client-cert") == str(TLS_DIR / "tls.crt")
        if "httpGet" in probe:
            assert probe["httpGet"]["scheme"] == "HTTPS"


# -- graceful stop ---------------------------------------------------------------------------------
STOP_MARGIN_S = 10  # what a drained server gets to stop before the kubelet kills it
DRAIN_VARIABLE = {"gateway": "LORASTREAM_GATEWAY_DRAIN_SECONDS",
                  "gpu-worker": "LORASTREAM_WORKER_DRAIN_SECONDS"}


def grace_shortfall(
    workload: dict[str, Any], name: str, env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> float:
    """Seconds by which the pod's grace period misses the preStop sleep + the drain the container
    is configured with + STOP_MARGIN_S (<= 0: it covers them)."""
    container = the_container(workload)
    settings = run_capturing(container["args"], env, SERVES[name], monkeypatch)
    command = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    pre_stop = float(command[1]) if command[:1] == ["sleep"] else 0.0
    grace = workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    return pre_stop + settings.drain_seconds + STOP_MARGIN_S - grace


@pytest.mark.parametrize("name", list(DRAIN_VARIABLE))
@pytest.mark.parametrize("drain", [None, "60"], ids=["as-deployed", "drain-raised-to-60s"])
def test_the_grace_period_covers_the_pre_stop_sleep_the_drain_and_a_margin(
    name: str, drain: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    (workload,) = [w for w in workloads(base()) if w["metadata"]["name"] == name]
    env = container_environment(workload)
    if drain is not None:  # a drain the grace period does not cover must be caught
        env[DRAIN_VARIABLE[name]] = drain
    shortfall = grace_shortfall(workload, name, env, monkeypatch)
    if drain is None:
        assert shortfall <= 0, f"{name}: terminationGracePeriodSeconds short by {shortfall} s"
    else:
        assert shortfall > 0


# -- metrics: scrape annotations and the optional monitoring component (deploy/k8s/monitoring) ----
def metrics_port(name: str, workload: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> int:
    """The port the container's server serves /metrics on, from the settings its args yield."""
    settings = run_capturing(the_container(workload)["args"], container_environment(workload),
                             SERVES[name], monkeypatch)
    return settings.port if name == "gateway" else settings.metrics_port


@pytest.mark.parametrize("name", list(SERVES))
def test_pods_carry_scrape_annotations_for_the_port_their_server_serves_metrics_on(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    (workload,) = [w for w in workloads(base()) if w["metadata"]["name"] == name]
    annotations = workload["spec"]["template"]["metadata"]["annotations"]
    port = metrics_port(name, workload, monkeypatch)
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == port
    assert port in {p["containerPort"] for p in the_container(workload)["ports"]}
    assert port == {"adapter-store": 9451, "gpu-worker": 9452, "gateway": 8000}[name]


def servicemonitor_problems(docs: list[dict[str, Any]]) -> list[str]:
    """Each part's Service is selected by the ServiceMonitor and exactly one of its endpoints
    names a port of that Service, whose target is the port the pod annotates for scraping."""
    (monitor,) = find(docs, "ServiceMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"].items()
    endpoints = [e["port"] for e in monitor["spec"]["endpoints"]]
    problems = []
    for name in SERVES:
        service = _by(docs, f"Service/{name}")
        if not selector <= service["metadata"]["labels"].items():
            problems.append(f"the ServiceMonitor does not select Service/{name}")
            continue
        ports = {p["name"]: p for p in service["spec"]["ports"]}
        scraped = [ports[e] for e in endpoints if e in ports]
        if len(scraped) != 1:
            problems.append(f"Service/{name}: {len(scraped)} endpoints scrape it")
            continue
        (workload,) = [w for w in workloads(docs) if w["metadata"]["name"] == name]
        declared = {p["name"]: p["containerPort"] for p in the_container(workload)["ports"]}
        target = declared.get(scraped[0]["targetPort"], scraped[0]["targetPort"])
        annotated = workload["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"]
        if target != int(annotated):
            problems.append(f"Service/{name}: the ServiceMonitor scrapes {target}, not {annotated}")
    return problems


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (its kustomize) not installed")
def test_the_monitoring_component_adds_a_servicemonitor_scraping_every_part() -> None:
    docs = list(yaml.safe_load_all(_with_components("monitoring")))
    (monitor,) = find(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["namespace"] == NAMESPACE
    assert all(e["path"] == "/metrics" for e in monitor["spec"]["endpoints"])
    assert servicemonitor_problems(docs) == []
    others = [d for d in docs if d["kind"] != "ServiceMonitor"]
    assert sorted(others, key=ident) == sorted(base(), key=ident)  # it only adds


MONITOR_BREAKAGES: list[tuple[str, Callable[[list[dict[str, Any]]], Any]]] = [
    ("endpoint-on-no-port", lambda docs: find(docs, "ServiceMonitor")[0]["spec"]["endpoints"]
     .pop(0)),
    ("selector-misses-the-services", lambda docs: find(docs, "ServiceMonitor")[0]["spec"]
     ["selector"]["matchLabels"].update({"app.kubernetes.io/part-of": "other"})),
    ("annotation-on-another-port", lambda docs: _by(docs, "Deployment/gpu-worker")["spec"]
     ["template"]["metadata"]["annotations"].update({"prometheus.io/port": "9999"})),
]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (its kustomize) not installed")
@pytest.mark.parametrize("breakage", [b for _, b in MONITOR_BREAKAGES],
                         ids=[name for name, _ in MONITOR_BREAKAGES])
def test_broken_monitoring_wiring_is_caught(
    breakage: Callable[[list[dict[str, Any]]], Any]
) -> None:
    docs = list(yaml.safe_load_all(_with_components("monitoring")))
    breakage(docs)
    assert servicemonitor_problems(docs)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (its kustomize) not installed")
def test_with_tls_the_gateway_pod_is_scraped_over_https() -> None:
    docs = list(yaml.safe_load_all(_with_components("monitoring", "tls")))
    annotations = _by(docs, "Deployment/gateway")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scheme"] == "https"
    for name in ("adapter-store", "gpu-worker"):  # their metrics stay plain HTTP
        (workload,) = [w for w in workloads(docs) if w["metadata"]["name"] == name]
        assert "prometheus.io/scheme" not in workload["spec"]["template"]["metadata"][
            "annotations"]
