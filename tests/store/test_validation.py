"""Adapter validation: good PEFT adapters pass with exact offsets and checksums; every kind of bad
input is refused with a message that says what is wrong, leaves nothing behind in the cache, and
the store keeps serving."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lorastream.core import errors
from lorastream.core.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from lorastream.core.adapter_validation import layer_order, validate_adapter_dir
from tests.store.fixtures_core import (
    StoreFactory,
    assert_cache_clean,
    assert_streams_intact,
    copy_adapter,
    read_header,
    write_header,
)
from tests.support.models import ALORA_INVOCATION

Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
K_A = "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
Q_M = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"


@pytest.mark.parametrize(
    ("adapter", "rank", "alpha", "rslora", "targets"),
    [
        ("attn-r4", 4, 16.0, False, ("k_proj", "o_proj", "q_proj", "v_proj")),
        ("all-r8", 8, 16.0, False, tuple(sorted(
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))),
        ("mlp-r16", 16, 16.0, True, ("down_proj", "gate_proj", "up_proj")),
        ("dora-attn-r4", 4, 16.0, False, ("k_proj", "o_proj", "q_proj", "v_proj")),
        ("alora-attn-r4", 4, 16.0, False, ("k_proj", "o_proj", "q_proj", "v_proj")),
    ],
)
def test_valid_peft_adapter_yields_config_fields_offsets_and_checksums(
    tiny_adapters: dict[str, Path], adapter: str, rank: int, alpha: float, rslora: bool,
    targets: tuple[str, ...],
) -> None:
    directory = tiny_adapters[adapter]
    result = validate_adapter_dir(directory)
    assert (result.rank, result.alpha, result.use_rslora) == (rank, alpha, rslora)
    assert result.target_modules == targets
    assert result.use_dora is adapter.startswith("dora")
    expected_invocation = tuple(ALORA_INVOCATION) if adapter.startswith("alora") else ()
    assert result.alora_invocation_tokens == expected_invocation
    magnitudes = [t for t in result.tensors if t.info.name.endswith(".lora_magnitude_vector")]
    assert len(magnitudes) == (2 * len(targets) if result.use_dora else 0)  # per layer, module
    assert result.base_model.endswith("base")
    original = load_file(str(directory / WEIGHTS_FILE))
    assert {t.info.name for t in result.tensors} == set(original)
    raw = (directory / WEIGHTS_FILE).read_bytes()
    names = [t.info.name for t in result.tensors]
    assert names == sorted(names, key=layer_order)  # layer order: the stream's (test_layer_order)
    for t in result.tensors:
        expected = original[t.info.name].numpy().tobytes()
        assert raw[t.file_offset : t.file_offset + t.info.nbytes] == expected
        assert t.info.checksum == hashlib.sha256(expected).hexdigest()
        assert t.info.shape == tuple(original[t.info.name].shape)


# -- corruptions of a copy of the attention r4 adapter -------------------------------------------
def _truncate(cut: int) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        raw = (d / WEIGHTS_FILE).read_bytes()
        (d / WEIGHTS_FILE).write_bytes(raw[:cut])

    return mutate


def _corrupt_header_json(d: Path) -> None:
    raw = bytearray((d / WEIGHTS_FILE).read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    raw[8 : 8 + n] = b"{" + b"\xff" * (n - 1)
    (d / WEIGHTS_FILE).write_bytes(bytes(raw))


def _declare_header_length(length: int) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        raw = (d / WEIGHTS_FILE).read_bytes()
        (d / WEIGHTS_FILE).write_bytes(struct.pack("<Q", length) + raw[8:])

    return mutate


def _edit_header(edit: Callable[[dict[str, dict]], None]) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        header, data = read_header(d / WEIGHTS_FILE)
        edit(header)
        write_header(d / WEIGHTS_FILE, header, data)

    return mutate


def _last_tensor_past_the_end(header: dict[str, dict]) -> None:
    key = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    begin, end = header[key]["data_offsets"]
    header[key]["data_offsets"] = [begin + 4096, end + 4096]


def _pad_metadata(nbytes: int) -> Callable[[dict[str, dict]], None]:
    def edit(header: dict[str, dict]) -> None:
        header["__metadata__"] = {"format": "pt", "padding": "x" * nbytes}

    return edit


def _overlap_two_tensors(header: dict[str, dict]) -> None:
    header[Q_A]["data_offsets"] = list(header[K_A]["data_offsets"])  # both [4, 64] F32


def _set(key: str, field: str, value: object) -> Callable[[dict[str, dict]], None]:
    def edit(header: dict[str, dict]) -> None:
        header[key][field] = value

    return edit


def _edit_tensors(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        tensors = load_file(str(d / WEIGHTS_FILE))
        edit(tensors)
        save_file(tensors, str(d / WEIGHTS_FILE), metadata={"format": "pt"})

    return mutate


def _b_of_rank_3(t: dict[str, torch.Tensor]) -> None:
    t[Q_B] = torch.randn(t[Q_B].shape[0], 3)  # A is [4, 64]: [out, 3] disagrees


def _drop_q_b(t: dict[str, torch.Tensor]) -> None:
    del t[Q_B]


def _add_lm_head(t: dict[str, torch.Tensor]) -> None:
    """A LoRA on lm_head of rank 3 (the adapter's r is 4)."""
    t["base_model.model.lm_head.lora_A.weight"] = torch.randn(3, 64)
    t["base_model.model.lm_head.lora_B.weight"] = torch.randn(256, 3)


def _new_rows(count: int) -> Callable[[Path], None]:
    """``count`` new embedding rows, for 2 trainable token ids in the config."""
    edit_config = _config(trainable_token_indices=[3, 4])

    def mutate(d: Path) -> None:
        edit_config(d)
        _edit_tensors(lambda t: t.update({
            "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta":
                torch.randn(count, 64)}))(d)

    return mutate


def _rows_and_saved_embedding(t: dict[str, torch.Tensor]) -> None:
    t["base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"] = (
        torch.randn(2, 64))
    t["base_model.model.model.embed_tokens.weight"] = torch.randn(256, 64)


def _add_embedding(t: dict[str, torch.Tensor]) -> None:
    t["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.randn(4, 256)


def _add_expert(part: str, rows: int = 4) -> Callable[[dict[str, torch.Tensor]], None]:
    """A LoRA pair on a MoE block's ``part`` of layer 0 (``experts.0.gate_proj``, ...), A of
    ``rows`` rows (the adapter's rank is 4)."""

    def edit(t: dict[str, torch.Tensor]) -> None:
        prefix = f"base_model.model.model.layers.0.{part}"
        t[f"{prefix}.lora_A.weight"] = torch.randn(rows, 64)
        t[f"{prefix}.lora_B.weight"] = torch.randn(32, rows)

    return edit


def _only_non_lora(t: dict[str, torch.Tensor]) -> None:
    t.clear()


def _add_q_magnitude(t: dict[str, torch.Tensor]) -> None:
    t[Q_M] = torch.rand(t[Q_B].shape[0])


def _as_dora(q_magnitude_out: int | None) -> Callable[[Path], None]:
    """DoRA: use_dora and a magnitude [out] per adapted module, layer 0 q_proj's
    ``[q_magnitude_out]`` (None: none at all for it)."""
    def mutate(d: Path) -> None:
        _config(use_dora=True)(d)
        tensors = load_file(str(d / WEIGHTS_FILE))
        for key in [k for k in tensors if k.endswith(".lora_B.weight")]:
            tensors[key.replace(".lora_B.weight", ".lora_magnitude_vector")] = torch.rand(
                tensors[key].shape[0])
        del tensors[Q_M]
        if q_magnitude_out is not None:
            tensors[Q_M] = torch.rand(q_magnitude_out)
        save_file(tensors, str(d / WEIGHTS_FILE), metadata={"format": "pt"})

    return mutate


def _config(**changes: object) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        config = json.loads((d / CONFIG_FILE).read_text())
        config.update(changes)
        (d / CONFIG_FILE).write_text(json.dumps(config))

    return mutate


def _both(*mutations: Callable[[Path], None]) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        for m in mutations:
            m(d)

    return mutate


def _config_not_json(d: Path) -> None:
    (d / CONFIG_FILE).write_text('{"r": 4, ')


def _no_config(d: Path) -> None:
    (d / CONFIG_FILE).unlink()


def _pickle_only(d: Path) -> None:
    (d / WEIGHTS_FILE).unlink()
    (d / "adapter_model.bin").write_bytes(b"\x80\x04 a pickle that must never be loaded")


BAD_ADAPTERS = [
    ("truncated-data", _truncate(-100), {}, "truncated"),
    ("truncated-in-header", _truncate(8 + 10), {}, "truncated"),
    ("shorter-than-prefix", _truncate(5), {}, "truncated"),
    ("corrupt-header-json", _corrupt_header_json, {}, "header is not valid JSON"),
    ("declared-header-1tib", _declare_header_length(1 << 40), {}, "above the"),
    ("header-above-cap", _edit_header(_pad_metadata(100_000)), {"max_header_bytes": 65536},
     "10[0-9]{4}-byte header, above the 65536-byte cap"),
    ("offsets-past-end", _edit_header(_last_tensor_past_the_end), {}, "past the"),
    ("offsets-overlap", _edit_header(_overlap_two_tensors), {}, "overlaps"),
    ("offsets-span-wrong", _edit_header(_set(Q_A, "shape", [4, 65])), {}, "needs"),
    ("dtype-int64", _edit_header(_set(Q_A, "dtype", "I64")), {}, "dtype 'I64'"),
    ("rank-mismatch-a-b", _edit_tensors(_b_of_rank_3), {}, "rank mismatch"),
    ("rank-not-config-r", _config(r=8), {}, "says r=8"),
    ("missing-b", _edit_tensors(_drop_q_b), {}, "no lora_B"),
    ("lm-head-rank", _edit_tensors(_add_lm_head), {}, "lm_head.lora_A.weight has rank 3"),
    ("embedding-lora-a-alone", _edit_tensors(_add_embedding), {},
     "embed_tokens has lora_A without its pair"),
    ("new-rows-not-the-ids", _new_rows(3), {},
     "has 3 rows but trainable_token_indices lists 2"),
    ("new-rows-without-ids", _edit_tensors(_rows_and_saved_embedding), {},
     "trainable_token_indices in adapter_config.json and a token_adapter"),
    ("no-lora-tensors", _edit_tensors(_only_non_lora), {}, "no LoRA tensors"),
    ("other-module-in-config", _config(target_modules=["q_proj", "score"]), {}, "score"),
    ("raw-target-parameters", _config(target_parameters=["self_attn.q_proj.weight"]), {},
     r"target_parameters .* only on a mixture-of-experts block's .* not on self_attn"),
    ("shared-gate-raw-parameter", _config(target_parameters=["mlp.shared_expert_gate.weight"]),
     {}, r"only on a mixture-of-experts block's .* router gate.weight, not on mlp.shared_exp"),
    ("moe-expert-rank", _edit_tensors(_add_expert("mlp.experts.0.gate_proj", rows=3)), {},
     r"layer 0 experts.0.gate_proj has rank 3 but adapter_config.json says r=4"),
    ("mixtral-expert-rank", _edit_tensors(_add_expert("block_sparse_moe.experts.3.w1", 3)), {},
     r"layer 0 experts.3.gate_proj has rank 3"),
    ("fused-experts-rank", _edit_tensors(_add_expert("mlp.experts", rows=6)), {},
     r"layer 0 experts: lora_A is \[6, 64\], not \[experts \* r, in\] with r=4"),
    ("dora-without-magnitudes", _config(use_dora=True), {}, "no lora_magnitude_vector"),
    ("dora-magnitude-missing", _as_dora(None), {}, "q_proj has no lora_magnitude_vector"),
    ("dora-magnitude-wrong-shape", _as_dora(63), {},
     r"q_proj: lora_magnitude_vector is \[63\].*must be \[64\]"),
    ("magnitude-without-use-dora", _edit_tensors(_add_q_magnitude), {}, "does not set use_dora"),
    ("alora-empty-invocation", _config(alora_invocation_tokens=[]), {},
     r"alora_invocation_tokens .* must be a non-empty list of token ids"),
    ("alora-negative-token", _config(alora_invocation_tokens=[3, -1]), {},
     r"alora_invocation_tokens .* holds \[-1\], which are not token ids"),
    ("alora-text-not-ids", _config(alora_invocation_tokens="<|assistant|>"), {},
     "must be a non-empty list of token ids"),
    ("alora-with-dora", _both(_as_dora(64), _config(alora_invocation_tokens=[3, 4])), {},
     "together with use_dora=true; PEFT serves no such combination"),
    ("vera", _config(peft_type="VERA"), {}, "peft_type is 'VERA'"),
    ("loha", _config(peft_type="LOHA"), {}, "peft_type is 'LOHA'"),
    ("trainable-tokens-without-rows", _config(trainable_token_indices=[3, 4]), {},
     "trainable_token_indices"),
    ("trainable-tokens-of-lm-head", _config(trainable_token_indices={"lm_head": [3]}), {},
     "trainable_token_indices is supported only for embed_tokens, not lm_head"),
    ("rank-pattern-disagrees", _config(rank_pattern={"q_proj": 8}), {},
     r"layer 0 q_proj has rank 4 but adapter_config.json says rank_pattern\['q_proj'\]=8"),
    ("rank-pattern-exact-name", _config(rank_pattern={"model.layers.1.self_attn.k_proj": 2}),
     {}, r"layer 1 k_proj has rank 4 but .* rank_pattern\['model.layers.1.self_attn.k_proj'\]=2"),
    ("rank-pattern-zero", _config(rank_pattern={"q_proj": 0}), {},
     r"rank_pattern\['q_proj'\] is 0; a rank must be a positive integer"),
    ("rank-pattern-not-int", _config(rank_pattern={"q_proj": 4.5}), {},
     r"rank_pattern\['q_proj'\] is 4.5; a rank must be a positive integer"),
    ("rank-pattern-list", _config(rank_pattern=["q_proj"]), {},
     "rank_pattern must be a JSON object of module pattern -> value"),
    ("rank-pattern-bad-regex", _config(rank_pattern={"q_proj(": 4}), {},
     r"rank_pattern key 'q_proj\(' is not a regular expression"),
    ("alpha-pattern-text", _config(alpha_pattern={"q_proj": "16"}), {},
     r"alpha_pattern\['q_proj'\] is '16'; an alpha must be a finite number"),
    ("bias-all", _config(bias="all"), {}, "bias"),
    ("modules-to-save-other", _config(modules_to_save=["lm_head", "score"]), {},
     "modules_to_save is supported only for embed_tokens and lm_head, not score"),
    ("not-lora", _config(peft_type="IA3"), {}, "peft_type"),
    ("config-not-json", _config_not_json, {}, "not valid JSON"),
    ("missing-config", _no_config, {}, CONFIG_FILE),
    ("pickle-only", _pickle_only, {}, "pickle"),
]


@pytest.mark.parametrize(
    ("mutate", "store_kwargs", "message"),
    [pytest.param(m, kw, msg, id=case) for case, m, kw, msg in BAD_ADAPTERS],
)
def test_bad_adapter_is_refused_clearly_leaving_no_trace_and_the_store_serving(
    tiny_adapters: dict[str, Path],
    store_factory: StoreFactory,
    tmp_path: Path,
    mutate: Callable[[Path], None],
    store_kwargs: dict[str, int],
    message: str,
) -> None:
    store = store_factory(**store_kwargs)
    store.preload(str(tiny_adapters["mlp-r16"]), "keep")
    bad = copy_adapter(tiny_adapters["attn-r4"], tmp_path / "bad")
    mutate(bad)
    with pytest.raises(errors.InvalidAdapter, match=message) as info:
        store.preload(str(bad), "bad")
    assert str(bad) in str(info.value)  # says which adapter
    assert [m.name for m in store.list()] == ["keep"]
    assert_cache_clean(store, tmp_path / "cache")
    assert_streams_intact(store, "keep")
    good = store.preload(str(tiny_adapters["attn-r4"]), "bad")  # the name is still free
    assert good.rank == 4
    assert_cache_clean(store, tmp_path / "cache")


@pytest.mark.parametrize(
    ("uri", "expected", "message"),
    [
        ("ftp://host/adapter", errors.InvalidArgument, "supported"),
        ("relative/dir", errors.InvalidArgument, "absolute"),
        ("file://otherhost/x", errors.InvalidArgument, "file:///abs/path"),
        ("/does/not/exist", errors.AdapterNotFound, "no such directory"),
        ("file:///does/not/exist", errors.AdapterNotFound, "no such directory"),
        ("", errors.InvalidArgument, "empty"),
    ],
)
def test_bad_source_uri_is_refused_clearly_and_the_store_keeps_serving(
    tiny_adapters: dict[str, Path], store_factory: StoreFactory, tmp_path: Path,
    uri: str, expected: type[Exception], message: str,
) -> None:
    store = store_factory()
    with pytest.raises(expected, match=message):
        store.preload(uri, "x")
    assert_cache_clean(store, tmp_path / "cache")
    assert store.preload(f"file://{tiny_adapters['attn-r4']}", "x").rank == 4


def test_a_weights_file_instead_of_its_directory_is_refused(
    tiny_adapters: dict[str, Path], store_factory: StoreFactory
) -> None:
    with pytest.raises(errors.InvalidArgument, match="directory"):
        store_factory().preload(str(tiny_adapters["attn-r4"] / WEIGHTS_FILE), "x")


@pytest.mark.parametrize(
    "name",
    ["../x", "/abs", "a/../../b", "a/./b", "..", "a//b", "a/", "", "sp ace", "x" * 129, "a\\b",
     "é"],
)
def test_malformed_or_traversing_names_are_refused_everywhere(
    tiny_adapters: dict[str, Path], store_factory: StoreFactory, tmp_path: Path, name: str
) -> None:
    store = store_factory()
    for call in (
        lambda: store.preload(str(tiny_adapters["attn-r4"]), name),
        lambda: store.describe(name),
        lambda: store.delete(name),
        lambda: store.pin(name),
        lambda: store.open_stream(name),
    ):
        with pytest.raises(errors.InvalidArgument, match="name"):
            call()
    assert_cache_clean(store, tmp_path / "cache")


@pytest.mark.parametrize("name", ["a", "org/model-v1.2_final", "A.b-c_d/e/f", "x" * 128])
def test_well_formed_names_are_accepted(
    tiny_adapters: dict[str, Path], store_factory: StoreFactory, name: str
) -> None:
    store = store_factory()
    assert store.preload(str(tiny_adapters["attn-r4"]), name).name == name
    assert store.describe(name).name == name


@pytest.mark.parametrize(
    ("rank_pattern", "alpha_pattern", "rank"),
    [
        ({"q_proj": 2}, {}, 4),  # smaller q: the adapter's rank stays r
        ({"q_proj": 8, "model.layers.1.self_attn.k_proj": 2}, {"q_proj": 3.0}, 8),  # largest
        ({}, {"v_proj": 12.0}, 4),  # alphas only
    ],
    ids=["smaller-q", "larger-q-exact-k", "alpha-only"],
)
def test_rank_and_alpha_patterns_resolve_per_module_and_survive_staging(
    store_factory: StoreFactory, tmp_path: Path, rank_pattern: dict[str, int],
    alpha_pattern: dict[str, float], rank: int,
) -> None:
    """A PEFT adapter with per-module ranks and alphas: its rank is the largest module's, each
    tensor's module resolves as PEFT resolves it, and the patterns survive the store's staging
    (a restart reads them back) and the wire."""
    from lorastream.core.codec import manifest_from_pb, manifest_to_pb
    from tests.support.models import make_family_adapter, make_tiny_family

    base = make_tiny_family("llama", tmp_path / "base", num_hidden_layers=2)
    adapter = make_family_adapter(base, tmp_path / "adapter", rank=4, alpha=8.0,
                                  targets=["q_proj", "k_proj", "v_proj"],
                                  rank_pattern=rank_pattern, alpha_pattern=alpha_pattern)
    staged = store_factory().preload(str(adapter), "patterned")
    restarted = store_factory().list()[0]
    for manifest in (staged, restarted, manifest_from_pb(manifest_to_pb(restarted))):
        assert manifest.rank == rank
        assert manifest.default_rank == 4
        assert dict(manifest.rank_pattern) == rank_pattern
        assert dict(manifest.alpha_pattern) == alpha_pattern
        for info in manifest.tensors:
            assert info.shape[0 if ".lora_A." in info.name else 1] == \
                manifest.module_rank(info.name)
    q_a, k1_a = (next(t.name for t in staged.tensors if t.name.endswith(end))
                 for end in ("layers.0.self_attn.q_proj.lora_A.weight",
                             "layers.1.self_attn.k_proj.lora_A.weight"))
    q_rank, q_alpha = rank_pattern.get("q_proj", 4), alpha_pattern.get("q_proj", 8.0)
    assert staged.module_scaling(q_a) == q_alpha / q_rank
    assert staged.module_rank(k1_a) == rank_pattern.get("model.layers.1.self_attn.k_proj", 4)
    assert staged.scaling == 8.0 / 4
