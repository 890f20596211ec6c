"""``/v1/models`` lists only the store's adapters that fit the base the workers serve.

The store, and its default cache shared by every stack on a machine, may hold adapters trained
for another base model; before, ``/v1/models`` listed them beside the served base's and each
failed only when a request named it ("trained for a different base model"). vLLM lists only what
it can serve; so does the gateway now, from the shape each worker publishes with its adapters.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from lorastream.core.adapter_fit import BaseShape, misfit
from lorastream.core.manifest import AdapterManifest
from lorastream.core.store_client import StoreClient
from lorastream.gateway.catalog import base_of, served_adapters
from lorastream.worker.model.config import ModelConfig
from tests.gateway.conftest import BASE, STORED_ADAPTERS, TOKEN, Cluster, ClusterFactory, wait_until
from tests.support.models import ATTENTION, make_peft_adapter, make_tiny_llama

# Adapters of other bases: wider projections (hidden 96), and one layer more than the tiny
# model's two (the same widths: only the layer count tells it apart).
OTHER_BASES: dict[str, dict[str, object]] = {
    "wider": {"hidden_size": 96, "intermediate_size": 160},
    "deeper": {"num_hidden_layers": 3},
}


@pytest.fixture(scope="module")
def other_bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> (base checkpoint, adapter) of each of OTHER_BASES."""
    root = tmp_path_factory.mktemp("other-bases")
    return {name: make_tiny_llama(root / name, **overrides)
            for name, overrides in OTHER_BASES.items()}


@pytest.fixture(scope="module")
def mixed_store(cluster_factory: ClusterFactory, other_bases: dict[str, Path],
                tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    """One worker on the tiny model; its store also holds an adapter of each other base."""
    cluster = cluster_factory(workers=1)
    root = tmp_path_factory.mktemp("other-adapters")
    with StoreClient(cluster.store) as client:
        for name, base in other_bases.items():
            adapter = make_peft_adapter(base, root / name, rank=4, targets=ATTENTION)
            for _ in client.preload(str(adapter), name):
                pass
    assert wait_until(lambda: bool(cluster.gateway.state.pool.bases()))
    return cluster


def test_models_lists_only_the_adapters_that_fit_the_served_base(mixed_store: Cluster) -> None:
    client = mixed_store.gateway.openai()
    models = {m.id: m for m in client.models.list()}
    assert set(models) == {BASE, *STORED_ADAPTERS}
    assert {models[name].parent for name in STORED_ADAPTERS} == {BASE}  # type: ignore[attr-defined]  # parent: a field the server adds
    # the control: the store holds the others, and operators still see them there
    with mixed_store.gateway.http(TOKEN) as operator:
        stored = {a["name"] for a in operator.get("/v1/adapters").json()["data"]}
    assert stored >= {*STORED_ADAPTERS, *OTHER_BASES}


@pytest.mark.parametrize(("name", "why"), [
    ("wider", r"layer 0 k_proj lora_A is \[4, 96\], but the base model needs \[4, 64\]"),
    ("deeper", r"it adapts layer 2, but the base model has 2 layers"),
])
def test_an_adapter_of_another_base_is_not_found_saying_why(
    mixed_store: Cluster, name: str, why: str,
) -> None:
    client = mixed_store.gateway.openai()
    with pytest.raises(openai.NotFoundError, match=f"trained for a different base model.*{why}"):
        client.models.retrieve(name)
    assert client.models.retrieve("attn-r4").parent == BASE  # type: ignore[attr-defined]  # parent: a field the server adds
    # what the list now says is what a request meets: the worker refuses it too
    with pytest.raises(openai.APIError, match="different base model"):
        client.completions.create(model=name, prompt="abc", max_tokens=2)


# -- the judgement itself, on real manifests and real model configs --------------------------------
@pytest.fixture(scope="module")
def manifests(mixed_store: Cluster) -> dict[str, AdapterManifest]:
    with StoreClient(mixed_store.store) as client:
        return {name: client.describe(name) for name in (*STORED_ADAPTERS, *OTHER_BASES)}


def shape_of(checkpoint: Path) -> BaseShape:
    config = ModelConfig.from_dir(checkpoint)
    return BaseShape(config.num_layers, config.module_shapes())


def test_each_adapter_fits_its_own_base_only(
    manifests: dict[str, AdapterManifest], other_bases: dict[str, Path], tiny_model: Path,
) -> None:
    shapes = {"tiny": shape_of(tiny_model), **{n: shape_of(p) for n, p in other_bases.items()}}
    own = {**{name: "tiny" for name in STORED_ADAPTERS}, **{name: name for name in OTHER_BASES}}
    for name, manifest in manifests.items():
        fits = {base for base, shape in shapes.items() if misfit(manifest, shape) is None}
        # a deeper base has every layer a 2-layer adapter adapts, at the same widths
        expected = {own[name], "deeper"} if own[name] == "tiny" else {own[name]}
        assert fits == expected, name


def test_with_two_bases_served_each_adapter_is_listed_under_the_one_it_fits(
    manifests: dict[str, AdapterManifest], other_bases: dict[str, Path], tiny_model: Path,
) -> None:
    bases = {"tiny": shape_of(tiny_model), "wide": shape_of(other_bases["wider"])}
    listed = served_adapters(list(manifests.values()), bases, "tiny")
    assert {m.name: parent for m, parent in listed} == {
        **{name: "tiny" for name in STORED_ADAPTERS}, "wider": "wide",
    }
    parent, why_not = base_of(manifests["deeper"], bases, "tiny")
    assert parent is None and why_not is not None
    assert why_not.startswith("not tiny: it adapts layer 2") and "; not wide: " in why_not


def test_a_worker_that_says_no_shape_leaves_every_adapter_listed(
    manifests: dict[str, AdapterManifest],
) -> None:
    """An older worker sends no shape (0 layers, no modules): the pool keeps no base for it,
    and with no base known nothing is judged (the list as before)."""
    assert not BaseShape(0, {}).known
    listed = served_adapters(list(manifests.values()), {}, BASE)
    assert [(m.name, parent) for m, parent in listed] == [(n, BASE) for n in sorted(manifests)]
