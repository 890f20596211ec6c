"""Issue 25 item 2: adapters pushed to the store straight from a client (the CLI, StoreClient,
a training loop's state dict), against real store servers on port 0 and real PEFT adapters.

A push is staged like a preload (validated, content-addressed, atomic) from ``push://<name>``;
a refused one leaves nothing in the cache and the name as it was.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file, save
from typer.testing import CliRunner

from lorastream.adapter_store.v1 import adapter_store_pb2_grpc as pb_grpc
from lorastream.cli.main import app
from lorastream.core import codec, errors
from lorastream.core.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from lorastream.core.adapter_validation import content_id
from lorastream.core.generation import PromptInput, SamplingParams
from lorastream.core.grpc_status import raise_from_rpc_error
from lorastream.core.manifest import AdapterManifest
from lorastream.core.push import adapter_config_bytes, push_state_dict
from lorastream.core.store_client import StoreClient
from lorastream.core.upload import UploadChunk, UploadFile, UploadHeader, UploadItem, upload_items
from lorastream.core.worker_client import WorkerClient
from lorastream.store.config import StoreSettings
from lorastream.store.server import create_server
from tests.support.models import (
    ALL_LINEAR,
    ATTENTION,
    make_peft_adapter,
    make_tiny_checkpoint,
    save_adapter_tokenizer,
)
from tests.worker.conftest import NEW_TOKENS, PROMPTS, peft_model, reference_greedy

OPERATE, READ = "push-operate-token", "push-read-token"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("push") / "model")


@pytest.fixture(scope="module")
def adapter_dir(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real PEFT adapter (all-linear, rank 8, random B) saved by save_pretrained."""
    root = tmp_path_factory.mktemp("push-adapters")
    return make_peft_adapter(checkpoint, root / "all-r8", rank=8, targets=ALL_LINEAR, seed=21,
                             b_std=0.2)


@dataclass(frozen=True)
class Store:
    target: str
    cache: Path

    def staged_ids(self) -> list[str]:
        return sorted(entry.name for entry in (self.cache / "adapters").iterdir())

    def leftovers(self) -> list[str]:
        """Whatever is under cache/tmp: partial uploads, if any were left behind."""
        return sorted(entry.name for entry in (self.cache / "tmp").iterdir())


@pytest.fixture
def start_store(tmp_path: Path) -> Iterator[Callable[..., Store]]:
    """Start store servers on port 0, each on its own cache dir; stopped at teardown."""
    servers: list[grpc.Server] = []

    def start(**settings: object) -> Store:
        cache = tmp_path / f"cache-{len(servers)}"
        server, port, _ = create_server(StoreSettings(port=0, cache_dir=cache, **settings))
        server.start()
        servers.append(server)
        return Store(f"127.0.0.1:{port}", cache)

    yield start
    for server in servers:
        server.stop(None).wait()


def _files(directory: Path) -> list[tuple[str, bytes]]:
    return [(name, (directory / name).read_bytes()) for name in (CONFIG_FILE, WEIGHTS_FILE)]


def _preload(client: StoreClient, directory: Path, name: str) -> AdapterManifest:
    events = list(client.preload(str(directory), name))
    assert events[-1].manifest is not None
    return events[-1].manifest


def _raw_upload(target: str, items: list[UploadItem], token: str | None = None) -> None:
    """Send ``items`` as they are (no client-side checks), raising the store's domain error."""
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.AdapterStoreServiceStub(channel)
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        try:
            stub.UploadAdapter((codec.upload_request_to_pb(i) for i in items), metadata=metadata)
        except grpc.RpcError as err:
            raise_from_rpc_error(err)


def _generate(worker: str, model: str, prompt: list[int]) -> list[int]:
    tokens: list[int] = []
    with WorkerClient(worker) as client:
        for event in client.generate(
            model, PromptInput(token_ids=tuple(prompt)), SamplingParams(max_tokens=NEW_TOKENS)
        ):
            tokens.extend(event.token_ids)
    return tokens


def test_a_directory_pushed_by_the_cli_or_the_client_is_served_with_peft_identical_tokens(
    start_store: Callable[..., Store], checkpoint: Path, adapter_dir: Path, tmp_path: Path
) -> None:
    store = start_store()
    result = CliRunner().invoke(app, ["adapters", "push", str(adapter_dir), "--name", "by-cli",
                                      "--pin", "--store", store.target])
    assert result.exit_code == 0, result.output
    assert "pushed by-cli" in result.output and "pinned" in result.output
    sent: list[tuple[int, int]] = []
    with StoreClient(store.target) as client:
        pushed = client.push(adapter_dir, "by-client", on_sent=lambda *n: sent.append(n))
        by_cli = client.describe("by-cli")
    file_bytes = sum((adapter_dir / name).stat().st_size for name in (CONFIG_FILE, WEIGHTS_FILE))
    assert sent[-1] == (file_bytes, file_bytes)
    assert (by_cli.source_uri, by_cli.pinned) == ("push://by-cli", True)
    assert (pushed.source_uri, pushed.pinned) == ("push://by-client", False)
    assert pushed.adapter_id == by_cli.adapter_id == content_id(adapter_dir)
    assert store.staged_ids() == [pushed.adapter_id] and store.leftovers() == []

    from lorastream.worker.service.bootstrap import build_engine
    from lorastream.worker.service.config import WorkerSettings
    from lorastream.worker.service.server import create_server as create_worker

    settings = WorkerSettings(
        model=str(checkpoint), served_model_name="tiny", port=0, store=store.target,
        max_loras=2, kv_cache_bytes=8 << 20, model_cache_dir=tmp_path / "models",
    )
    engine = build_engine(settings, checkpoint=checkpoint)
    server, port, _ = create_worker(settings, engine)
    server.start()
    try:
        reference = peft_model(checkpoint, adapter_dir)
        base = peft_model(checkpoint, None)
        for prompt in PROMPTS:
            expected = reference_greedy(reference, prompt, NEW_TOKENS)
            for name in ("by-cli", "by-client"):
                assert _generate(f"127.0.0.1:{port}", name, prompt) == expected, (name, prompt)
        assert any(
            reference_greedy(base, p, NEW_TOKENS) != reference_greedy(reference, p, NEW_TOKENS)
            for p in PROMPTS
        ), "the adapter changes nothing: the comparison would prove nothing"
    finally:
        server.stop(None).wait()
        engine.stop()


@pytest.mark.parametrize("config_as", ["LoraConfig", "dict"])
def test_a_state_dict_push_has_the_content_id_of_save_pretrained_then_preload(
    start_store: Callable[..., Store], checkpoint: Path, tmp_path: Path, config_as: str
) -> None:
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import LlamaForCausalLM

    torch.manual_seed(7)
    base = LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION,
                                            lora_dropout=0.0, task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.1)
    config = model.peft_config["default"]
    store = start_store()
    with StoreClient(store.target) as client:
        pushed = push_state_dict(
            client, "from-memory", get_peft_model_state_dict(model),
            config if config_as == "LoraConfig" else config.to_dict(),
        )
        model.save_pretrained(tmp_path / "saved")
        preloaded = _preload(client, tmp_path / "saved", "from-disk")
    assert pushed.adapter_id == preloaded.adapter_id
    assert (pushed.source_uri, pushed.rank, pushed.target_modules) == (
        "push://from-memory", 4, tuple(sorted(ATTENTION))
    )
    assert pushed.tensors == preloaded.tensors
    assert store.staged_ids() == [pushed.adapter_id] and store.leftovers() == []


@pytest.mark.parametrize("route", ["cli", "client", "state-dict"])
def test_a_pushed_adapter_carries_its_tokenizer_in_its_content_id(
    start_store: Callable[..., Store], checkpoint: Path, adapter_dir: Path, tmp_path: Path,
    route: str
) -> None:
    """An adapter saved beside its own tokenizer (an added token on a reserved id), pushed by
    the CLI, the client or from memory: staged with its tokenizer files, verified as a preload
    is, with the content id of the same directory preloaded."""
    directory = tmp_path / "with-tokenizer"
    directory.mkdir()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        (directory / name).write_bytes((adapter_dir / name).read_bytes())
    save_adapter_tokenizer(checkpoint, directory, {200: "<tool>"})
    store = start_store()
    with StoreClient(store.target) as client:
        if route == "cli":
            result = CliRunner().invoke(app, ["adapters", "push", str(directory), "--name",
                                              "tool", "--store", store.target])
            assert result.exit_code == 0, result.output
            pushed = client.describe("tool")
        elif route == "client":
            pushed = client.push(directory, "tool")
        else:  # the config as push_state_dict serialises it, so that the directory matches
            config = json.loads((directory / CONFIG_FILE).read_text())
            (directory / CONFIG_FILE).write_bytes(adapter_config_bytes(config))
            pushed = push_state_dict(client, "tool", load_file(str(directory / WEIGHTS_FILE)),
                                     config, tokenizer_dir=directory)
        preloaded = _preload(client, directory, "tool-preloaded")
        names = [f.name for f in pushed.files]
        read = {n: client.read_file("tool", pushed.adapter_id, n) for n in names}
    assert names == ["tokenizer.json", "tokenizer_config.json"]
    assert read == {n: (directory / n).read_bytes() for n in names}
    assert pushed.adapter_id == preloaded.adapter_id == content_id(directory)
    assert pushed.files == preloaded.files and pushed.tokenizer_vocab == 256
    assert store.staged_ids() == [pushed.adapter_id] and store.leftovers() == []


def test_the_same_bytes_pushed_again_keep_one_copy_and_new_weights_replace_the_old(
    start_store: Callable[..., Store], adapter_dir: Path
) -> None:
    store = start_store()
    with StoreClient(store.target) as client:
        first = client.push(adapter_dir, "policy")
        again = client.push(_files(adapter_dir), "policy")
        other = client.push(adapter_dir, "policy-copy")
        assert first.adapter_id == again.adapter_id == other.adapter_id
        assert store.staged_ids() == [first.adapter_id]

        weights = load_file(str(adapter_dir / WEIGHTS_FILE))
        key = next(k for k in weights if "lora_B" in k)
        weights[key] = weights[key] * 2  # one training step later
        trained = [(CONFIG_FILE, (adapter_dir / CONFIG_FILE).read_bytes()),
                   (WEIGHTS_FILE, save(weights, metadata={"format": "pt"}))]
        newer = client.push(trained, "policy")
        assert newer.adapter_id != first.adapter_id
        assert client.describe("policy").adapter_id == newer.adapter_id
        assert store.staged_ids() == sorted([first.adapter_id, newer.adapter_id])
        client.delete("policy-copy")  # the old weights stay: they are policy's version 1
        assert store.staged_ids() == sorted([first.adapter_id, newer.adapter_id])
        client.delete("policy")  # the name and its history: every file goes
    assert store.staged_ids() == [] and store.leftovers() == []


def test_a_name_staged_from_another_source_needs_force(
    start_store: Callable[..., Store], adapter_dir: Path
) -> None:
    store = start_store()
    with StoreClient(store.target) as client:
        _preload(client, adapter_dir, "shared")
        with pytest.raises(errors.AlreadyExists, match="force"):
            client.push(adapter_dir, "shared")
        assert client.describe("shared").source_uri == str(adapter_dir)
        assert client.push(adapter_dir, "shared", force=True).source_uri == "push://shared"
        assert client.push(adapter_dir, "shared").source_uri == "push://shared"


# -- refused uploads -------------------------------------------------------------------------
# The store below takes 1 MiB of adapters and uploads of up to 4 MiB; the adapter is ~70 kB.
CACHE_BYTES, MAX_UPLOAD = 1 << 20, 4 << 20
Items = Callable[[Path], list[UploadItem]]


def _items(
    directory: Path, config: bytes | None = None, weights: bytes | None = None
) -> list[UploadItem]:
    """An upload of ``directory``'s files in 16 KiB chunks, either file replaced if given."""
    files = [(CONFIG_FILE, config or (directory / CONFIG_FILE).read_bytes()),
             (WEIGHTS_FILE, weights or (directory / WEIGHTS_FILE).read_bytes())]
    return list(upload_items("victim", files, chunk_bytes=16 << 10))


def _config(directory: Path, **changes: object) -> bytes:
    return json.dumps({**json.loads((directory / CONFIG_FILE).read_text()), **changes}).encode()


def _header_only(*sizes: int) -> list[UploadItem]:
    names = (CONFIG_FILE, WEIGHTS_FILE)
    return [UploadHeader("victim", False, False, tuple(map(UploadFile, names, sizes)))]


def _corrupt_a_chunk(items: list[UploadItem]) -> list[UploadItem]:
    chunk = items[3]
    assert isinstance(chunk, UploadChunk)
    data = bytearray(chunk.data)
    data[5] ^= 0xFF
    return [*items[:3], dataclasses.replace(chunk, data=bytes(data)), *items[4:]]


def _understate_the_config(items: list[UploadItem]) -> list[UploadItem]:
    header = items[0]
    assert isinstance(header, UploadHeader)
    files = (dataclasses.replace(header.files[0], size=header.files[0].size - 1), header.files[1])
    return [dataclasses.replace(header, files=files), *items[1:]]


REFUSALS: dict[str, tuple[Items, type[errors.LorastreamError], str]] = {
    "config-not-json": (lambda d: _items(d, config=b"{not json"),
                        errors.InvalidArgument, "not valid JSON"),
    "dora-config": (lambda d: _items(d, config=_config(d, use_dora=True)),
                    errors.InvalidArgument, "DoRA"),
    "config-rank-differs": (lambda d: _items(d, config=_config(d, r=16)),
                            errors.InvalidArgument, "has rank 8 but adapter_config.json says r=16"),
    "weights-not-safetensors": (lambda d: _items(d, weights=os.urandom(4096)),
                                errors.InvalidArgument, "adapter_model.safetensors"),
    "weights-truncated": (
        lambda d: _items(d, weights=(d / WEIGHTS_FILE).read_bytes()[:-100]),
        errors.InvalidArgument, "truncated"),
    "no-weights-file": (lambda d: list(upload_items("victim", _files(d)[:1])),
                        errors.InvalidArgument, "has no adapter_model.safetensors"),
    "a-path-outside": (lambda d: list(upload_items("victim", [*_files(d), ("../x", b"x")])),
                       errors.InvalidArgument, "holds only"),
    "tokenizer-without-tokenizer-json": (
        lambda d: list(upload_items("victim", [*_files(d), ("tokenizer_config.json", b"{}")])),
        errors.InvalidArgument, "without tokenizer.json"),
    "tokenizer-does-not-load": (
        lambda d: list(upload_items("victim", [*_files(d), ("tokenizer.json", b"{not json")])),
        errors.InvalidArgument, "its tokenizer does not load"),
    "no-header": (lambda d: _items(d)[1:], errors.InvalidArgument, "begin with its header"),
    "stream-ends-early": (lambda d: _items(d)[:-2], errors.InvalidArgument, "ended after"),
    "chunks-out-of-order": (lambda d: [*_items(d)[:2], *_items(d)[3:4], *_items(d)[2:3],
                                       *_items(d)[4:]], errors.InvalidArgument, "out of order"),
    "more-bytes-than-declared": (lambda d: _understate_the_config(_items(d)),
                                 errors.InvalidArgument, "more bytes arrived"),
    "corrupt-in-transit": (lambda d: _corrupt_a_chunk(_items(d)), errors.InvalidArgument,
                           "CRC-32C mismatch"),
    "above-max-upload-bytes": (lambda d: _header_only(700, MAX_UPLOAD), errors.CapacityExhausted,
                               "max-upload-bytes"),
    "above-the-cache-budget": (lambda d: _header_only(700, CACHE_BYTES), errors.CapacityExhausted,
                               "cache budget"),
}


@pytest.mark.parametrize("case", list(REFUSALS), ids=list(REFUSALS))
def test_a_refused_upload_leaves_nothing_staged_and_the_name_as_it_was(
    start_store: Callable[..., Store], adapter_dir: Path, case: str
) -> None:
    build, error, message = REFUSALS[case]
    store = start_store(cache_bytes=CACHE_BYTES, max_upload_bytes=MAX_UPLOAD)
    with StoreClient(store.target) as client:
        good = client.push(adapter_dir, "victim")
        with pytest.raises(error, match=message):
            _raw_upload(store.target, build(adapter_dir))
        assert client.describe("victim").adapter_id == good.adapter_id
    assert store.staged_ids() == [good.adapter_id]
    assert store.leftovers() == []


def test_an_upload_cancelled_mid_stream_leaves_no_partial_files(
    start_store: Callable[..., Store], adapter_dir: Path
) -> None:
    store = start_store()
    items = _items(adapter_dir)
    held = threading.Event()

    def requests() -> Iterator[object]:
        for i, item in enumerate(items):
            if i == 3:
                held.wait(timeout=30)  # the client stalls mid-upload, then is cancelled
            yield codec.upload_request_to_pb(item)

    with grpc.insecure_channel(store.target) as channel:
        call = pb_grpc.AdapterStoreServiceStub(channel).UploadAdapter.future(requests())
        deadline = time.monotonic() + 10
        while not store.leftovers():  # the store is receiving into cache/tmp/stage-*
            assert time.monotonic() < deadline, "the upload never started"
            time.sleep(0.01)
        call.cancel()
        held.set()
        while store.leftovers():
            assert time.monotonic() < deadline, f"partial upload left: {store.leftovers()}"
            time.sleep(0.01)
    assert store.staged_ids() == []
    with StoreClient(store.target) as client, pytest.raises(errors.AdapterNotFound):
        client.describe("victim")


@pytest.mark.parametrize(("token", "allowed"), [
    (None, False), ("wrong", False), (READ, False), (OPERATE, True),
], ids=["anonymous", "wrong", "read", "operate"])
def test_a_push_needs_the_operate_token(
    start_store: Callable[..., Store], adapter_dir: Path, token: str | None, allowed: bool
) -> None:
    store = start_store(token=OPERATE, read_token=READ)
    config = json.loads((adapter_dir / CONFIG_FILE).read_text())
    state_dict = load_file(str(adapter_dir / WEIGHTS_FILE))
    if not allowed:
        with pytest.raises(errors.Unauthenticated):
            push_state_dict(store.target, "guarded", state_dict, config, token=token)
        assert store.staged_ids() == [] and store.leftovers() == []
        return
    manifest = push_state_dict(store.target, "guarded", state_dict, config, token=token)
    assert manifest.source_uri == "push://guarded" and store.staged_ids() == [manifest.adapter_id]
