"""`lorastream adapters ...` against a real store server on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from safetensors.torch import load_file
from typer.testing import CliRunner

from lorastream.cli.main import app
from lorastream.store.config import StoreSettings
from lorastream.store.server import create_server
from tests.support.models import MLP, make_peft_adapter, make_tiny_llama

runner = CliRunner()
# The adapter JSON of the gateway's HTTP API (docs/gateway.md), which the CLI prints too.
MANIFEST_KEYS = {"name", "adapter_id", "source", "revision", "base_model", "rank", "alpha",
                 "use_rslora", "target_modules", "bytes", "tensors", "pinned", "created",
                 "last_used"}


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    base = make_tiny_llama(root / "base")
    return make_peft_adapter(base, root / "mlp-r8", rank=8, targets=MLP, use_rslora=True)


@pytest.fixture
def store(tmp_path: Path):
    server, port, _ = create_server(StoreSettings(port=0, cache_dir=tmp_path / "cache", token="t"))
    server.start()
    (tmp_path / "token").write_text("t\n")  # for --token-file
    yield f"127.0.0.1:{port}"
    server.stop(None).wait()


def _run(*args: str) -> str:
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def test_preload_ls_describe_pull_rm_round_trip(store: str, adapter: Path, tmp_path: Path) -> None:
    out = _run("adapters", "preload", str(adapter), "--name", "mlp", "--pin", "--store", store,
               "--token", "t")
    assert "staged mlp" in out and "pinned" in out
    token_file = str(tmp_path / "token")
    listed = json.loads(_run("adapters", "ls", "--json", "--store", store, "--token-file",
                             token_file))
    assert [a["name"] for a in listed["adapters"]] == ["mlp"]
    described = json.loads(_run("adapters", "describe", "mlp", "--store", store, "--token-file",
                                token_file))
    assert described["rank"] == 8 and described["use_rslora"] is True
    assert described.keys() - {"tensor_list"} == listed["adapters"][0].keys() == MANIFEST_KEYS
    assert len(described["tensor_list"]) == described["tensors"] > 0
    _run("adapters", "pull", "mlp", "--out", str(tmp_path / "pulled"), "--store", store,
         "--token-file", token_file)
    pulled = load_file(str(tmp_path / "pulled" / "adapter_model.safetensors"))
    original = load_file(str(adapter / "adapter_model.safetensors"))
    assert pulled.keys() == original.keys()
    for key, tensor in original.items():
        assert pulled[key].dtype == tensor.dtype and pulled[key].equal(tensor)
    from peft import LoraConfig

    config = LoraConfig.from_pretrained(str(tmp_path / "pulled"))
    assert config.r == 8 and config.use_rslora
    _run("adapters", "unpin", "mlp", "--store", store, "--token", "t")
    _run("adapters", "rm", "mlp", "--store", store, "--token", "t")
    assert json.loads(_run("adapters", "ls", "--json", "--store", store,
                           "--token", "t"))["adapters"] == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["adapters", "describe", "ghost", "--token", "t"], "AdapterNotFound"),
        (["adapters", "describe", "ghost"], "Unauthenticated"),
        (["adapters", "preload", f"{tempfile.gettempdir()}/nowhere", "--name", "x", "--token",
          "t"], "AdapterNotFound"),
        (["adapters", "preload", "/nowhere", "--name", "x", "--token", "t"], "InvalidArgument"),
        (["adapters", "preload", "/tmp", "--name", "x"], "Unauthenticated"),
        (["adapters", "rm", "ghost", "--token", "t"], "AdapterNotFound"),
    ],
)
def test_errors_print_one_clear_line_and_exit_1(store: str, args: list[str], message: str) -> None:
    result = runner.invoke(app, [*args, "--store", store])
    assert result.exit_code == 1
    assert message in result.output
    assert "Traceback" not in result.output


def test_unreachable_store_is_a_clear_error() -> None:
    result = runner.invoke(app, ["adapters", "ls", "--store", "127.0.0.1:1"])
    assert result.exit_code == 1
    assert "ServerUnreachable" in result.output and "cannot reach the server" in result.output


def test_help_explains_every_adapters_command() -> None:
    out = _run("adapters", "--help")
    for command in ("preload", "ls", "describe", "rm", "pin", "unpin", "pull"):
        assert command in out


def test_preload_takes_a_relative_path_from_the_current_directory(
    store: str, adapter: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(adapter.parent)
    _run("adapters", "preload", adapter.name, "--name", "rel", "--store", store, "--token", "t")
    (listed,) = json.loads(
        _run("adapters", "ls", "--json", "--store", store, "--token", "t")
    )["adapters"]
    assert listed["source"] == str(adapter.resolve())


def test_ls_folds_long_names_and_sources_into_80_columns(
    store: str, adapter: Path, tmp_path: Path
) -> None:
    deep = tmp_path / "a-directory-with-a-long-name" / "and-another-one-below-it" / adapter.name
    deep.parent.mkdir(parents=True)
    deep.symlink_to(adapter)
    name = "customer-support/en-v3-with-a-rather-long-adapter-name"
    _run("adapters", "preload", str(deep), "--name", name, "--store", store, "--token", "t")
    listing = subprocess.run(
        [sys.executable, "-m", "lorastream.cli.main", "adapters", "ls", "--store", store],
        env={**os.environ, "COLUMNS": "80", "LORASTREAM_TOKEN": "t"}, capture_output=True,
        text=True, check=True,
        timeout=60,
    ).stdout
    lines = listing.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in listing
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["name", "id"])
    starts = {word: lines[header].index(f" {word} ") + 1 for word in ("name", "id", "source")}
    rows = lines[header + 2:]  # below the header's rule

    def column(first: int, end: int | None) -> str:
        return "".join(line[first:end].strip() for line in rows)

    assert column(starts["name"], starts["id"]) == name
    assert column(starts["source"], None) == str(deep)
