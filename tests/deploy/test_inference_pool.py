"""The ``inference-pool`` component (``deploy/k8s/inference-pool/``): lorastream model-server pods
in an ``InferencePool`` routed by llm-d-router's endpoint picker.

Every document validates, offline, against its schema: the custom kinds against the
``openAPIV3Schema`` of the CRDs vendored in ``deploy/k8s/schemas/crds/`` (sha256-pinned here),
strictly (an object that lists its properties takes no other field, as ``kubectl apply
--validate=strict``); the built-in kinds against Kubernetes' strict v1.30 schemas
(``test_k8s.schema_errors``). ``kubectl kustomize`` renders the component where kubectl is
installed. On top, the wiring the schemas cannot see: the pool selects the model-server pods on
the OpenAI sidecar's port, the picker scrapes the worker's metrics port and scores with the
lora-affinity, queue and kv-cache scorers, the sidecar fronts its own worker only.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import shutil
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from jsonschema import Draft202012Validator

from tests.deploy.test_k8s import K8S, _with_components, find, ident, load, option, schema_errors

POOL = K8S / "inference-pool"
CRDS = K8S / "schemas" / "crds"
CRD_SHA256 = {
    "inference.networking.k8s.io_inferencepools.yaml":
        "55e0dbf39c50c4bbdd60106493a4573df4bb44479f9ce46762f1af718883e5cd",
    "llm-d.ai_inferenceobjectives.yaml":
        "c1e763412fcbe2b55e9282850156269a10053be2d052547cb80a2ca639c09990",
}
SCORERS = {"lora-affinity-scorer", "queue-scorer", "kv-cache-utilization-scorer"}
needs_kubectl = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl (its kustomize) not installed"
)


def _strict(node: Any) -> Any:
    """``node`` (a schema, walked whole) with ``additionalProperties: false`` on every object
    schema that lists properties and neither sets it nor preserves unknown fields (the API
    server's strict field check)."""
    if isinstance(node, dict):
        if node.get("type") == "object" and isinstance(node.get("properties"), dict) \
                and "additionalProperties" not in node \
                and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        for child in node.values():
            _strict(child)
    elif isinstance(node, list):
        for child in node:
            _strict(child)
    return node


@functools.cache
def crd_validators() -> dict[tuple[str, str], Draft202012Validator]:
    """(apiVersion, kind) -> a strict validator, for every served version of the vendored CRDs."""
    validators = {}
    for name in CRD_SHA256:
        crd = yaml.safe_load((CRDS / name).read_text())
        for version in crd["spec"]["versions"]:
            if version["served"]:
                schema = _strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
                key = (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])
                validators[key] = Draft202012Validator(schema)
    return validators


def errors(doc: dict[str, Any]) -> list[str]:
    validator = crd_validators().get((doc.get("apiVersion", ""), doc.get("kind", "")))
    if validator is None:
        return schema_errors(doc)  # a built-in kind
    return [
        f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in validator.iter_errors(doc)
    ]


def component() -> list[dict[str, Any]]:
    """The component's own documents (fresh copies), as the kustomization lists them."""
    kustomization = yaml.safe_load((POOL / "kustomization.yaml").read_text())
    return [doc for name in kustomization["resources"] for doc in load(POOL / name)]


def epp_config() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load((POOL / "epp-config.yaml").read_text())
    return config


@functools.cache
def _rendered_text() -> str:
    return _with_components("inference-pool")


def rendered() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(_rendered_text()) if d is not None]


def containers(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    (deployment,) = find(docs, "Deployment", "lorastream-model-server")
    return {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}


# -- schemas ---------------------------------------------------------------------------------------
def test_vendored_crds_are_the_pinned_files_with_their_licence() -> None:
    assert {p.name for p in CRDS.glob("*.yaml")} == set(CRD_SHA256)
    for name, digest in CRD_SHA256.items():
        assert hashlib.sha256((CRDS / name).read_bytes()).hexdigest() == digest, (
            f"{name} changed: vendor new CRDs on purpose and update CRD_SHA256"
        )
    assert "Apache License" in (CRDS / "LICENSE").read_text()
    assert "v1.6.0" in (CRDS / "README.md").read_text()


@pytest.mark.parametrize("doc", component(), ids=ident)
def test_component_document_validates_against_its_schema(doc: dict[str, Any]) -> None:
    assert errors(doc) == []


def _set(path: str, value: object) -> Callable[[dict[str, Any]], None]:
    def apply(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        for key in parents:
            doc = doc[key]
        doc[last] = value
    return apply


def _drop(path: str) -> Callable[[dict[str, Any]], None]:
    def apply(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        for key in parents:
            doc = doc[key]
        del doc[last]
    return apply


@pytest.mark.parametrize(("kind", "breakage"), [
    ("InferencePool", _set("spec.targetPort", [{"number": 8000}])),  # misspelled
    ("InferencePool", _drop("spec.selector")),  # required
    ("InferencePool", _set("spec.endpointPickerRef.failureMode", "FailSoft")),  # not an enum value
    ("InferencePool", _set("spec.targetPorts", [{"number": 70000}])),  # out of range
    ("InferencePool", _set("spec.targetPorts", [{"number": 8000, "name": "http"}])),  # no field
    ("InferenceObjective", _drop("spec.poolRef")),  # required
    ("InferenceObjective", _set("spec.poolRef.namespace", "other")),  # no such field
])
def test_broken_custom_resources_fail_validation(
    kind: str, breakage: Callable[[dict[str, Any]], None]
) -> None:
    (doc,) = [d for d in component() if d["kind"] == kind]
    breakage(doc)
    assert errors(doc) != []


# -- kustomize -------------------------------------------------------------------------------------
@needs_kubectl
def test_the_component_renders_and_every_document_validates() -> None:
    docs = rendered()
    kinds = {ident(d) for d in docs}
    assert {"InferencePool/lorastream", "InferenceObjective/interactive",
            "Deployment/lorastream-model-server", "StatefulSet/adapter-store",
            "ConfigMap/lorastream-epp-config", "ConfigMap/lorastream-config"} <= kinds
    assert not {"Deployment/gateway", "Deployment/gpu-worker"} & kinds, "base pool not replaced"
    assert all(d["metadata"]["namespace"] == "lorastream" for d in docs if d["kind"] != "Namespace")
    assert {ident(d): errors(d) for d in docs} == {ident(d): [] for d in docs}


@needs_kubectl
def test_the_rendered_picker_config_is_the_components_file() -> None:
    (config_map,) = find(rendered(), "ConfigMap", "lorastream-epp-config")
    assert yaml.safe_load(config_map["data"]["epp-config.yaml"]) == epp_config()


# -- wiring ----------------------------------------------------------------------------------------
def test_the_pool_selects_the_model_server_pods_on_the_openai_port() -> None:
    docs = component()
    (pool,) = find(docs, "InferencePool")
    (deployment,) = find(docs, "Deployment", "lorastream-model-server")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    openai = containers(docs)["openai"]
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [
        int(option(openai["args"], "--port"))
    ] == [p["containerPort"] for p in openai["ports"]]
    (objective,) = find(docs, "InferenceObjective")
    assert objective["spec"]["poolRef"]["name"] == pool["metadata"]["name"]


def test_the_sidecar_fronts_its_own_worker_only() -> None:
    pod = containers(component())
    worker, openai = pod["gpu-worker"], pod["openai"]
    assert openai["args"][:2] == ["gateway", "serve"]
    assert openai["args"].count("--worker") == 1
    assert option(openai["args"], "--worker") == f"127.0.0.1:{option(worker['args'], '--port')}"


def test_the_picker_scrapes_the_workers_metrics_port_and_scores_lora_queue_and_kv() -> None:
    config = epp_config()
    assert config["apiVersion"] == "llm-d.ai/v1alpha1" and config["kind"] == "EndpointPickerConfig"
    plugins = {p["type"]: p.get("parameters", {}) for p in config["plugins"]}
    worker = containers(component())["gpu-worker"]
    metrics_port = int(option(worker["args"], "--metrics-port"))
    assert plugins["metrics-data-source"]["port"] == metrics_port
    assert metrics_port in [p["containerPort"] for p in worker["ports"]]
    assert option(worker["args"], "--host") == "0.0.0.0"  # the metrics server binds it too
    (profile,) = config["schedulingProfiles"]
    used = {p["pluginRef"] for p in profile["plugins"]}
    assert SCORERS <= used <= set(plugins)
