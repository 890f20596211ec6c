"""``--model model.gguf``: a GGUF file converted once by transformers' GGUF loader, served like any
checkpoint (greedy tokens identical to transformers over the conversion), its Q8_0 weights held
in 8 bits again under ``--quantization int8``; a file that is not GGUF is a clear error."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from lorastream.core.errors import InvalidArgument
from lorastream.core.generation import PromptInput, SamplingParams
from lorastream.worker.engine.engine import Engine
from lorastream.worker.model.checkpoint import resolve_checkpoint
from lorastream.worker.model.embedded import embedded_gguf_path
from lorastream.worker.model.gguf_file import (
    SOURCE_FILE,
    convert_gguf_file,
    converted_gguf_dir,
)
from lorastream.worker.model.quant_linear import QuantLinear, dequantize
from lorastream.worker.service.bootstrap import build_engine
from lorastream.worker.service.config import WorkerSettings
from tests.support.gguf_files import TINY_GGUF, gguf_matrix, write_tiny_llama_gguf
from tests.worker.conftest import reference_greedy

PROMPT = "What is the capital of France?"
NEW_TOKENS = 12
MATRICES = 1 + 7 * TINY_GGUF["layers"]  # token_embd and 7 per layer
NORMS = 1 + 2 * TINY_GGUF["layers"]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gguf")
    return write_tiny_llama_gguf(embedded_gguf_path(), root / "tiny-llama.Q8_0.gguf")


@pytest.fixture(scope="module")
def converted(gguf_file: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the model cache, the converted checkpoint)."""
    cache = tmp_path_factory.mktemp("models")
    return cache, resolve_checkpoint(str(gguf_file), cache_dir=cache)


def test_the_file_is_converted_once_into_a_checkpoint_holding_its_values(
    gguf_file: Path, converted: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    from safetensors.torch import load_file

    cache, checkpoint = converted
    assert checkpoint == converted_gguf_dir(cache, gguf_file).resolve()
    weights = load_file(checkpoint / "model.safetensors")
    # Q8_0 dequantizes exactly: the checkpoint holds the file's int8 x fp16 values
    for gguf_name, hf_name in [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight"),
        ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight"),
    ]:
        assert torch.equal(weights[hf_name], torch.from_numpy(gguf_matrix(gguf_file, gguf_name)))
    mtime = checkpoint.stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger="lorastream"):
        assert resolve_checkpoint(str(gguf_file), cache_dir=cache) == checkpoint  # found
    assert checkpoint.stat().st_mtime_ns == mtime
    assert "converting" not in caplog.text
    assert f"Q8_0 x {MATRICES}: dequantized exactly" in caplog.text
    assert [p.name for p in cache.iterdir() if not p.name.startswith(".")] == [checkpoint.name]


def test_a_changed_file_gets_a_new_conversion_name(gguf_file: Path, tmp_path: Path) -> None:
    copy = tmp_path / gguf_file.name
    copy.write_bytes(gguf_file.read_bytes())
    before = converted_gguf_dir(tmp_path, copy)
    os.utime(copy, ns=(copy.stat().st_atime_ns, copy.stat().st_mtime_ns + 10**9))
    assert converted_gguf_dir(tmp_path, copy) != before
    assert before.name.startswith("gguf-tiny-llama.Q8_0-")


def test_the_first_start_converts_and_says_how_each_tensor_type_is_served(
    gguf_file: Path, converted: tuple[Path, Path], tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def copy_conversion(gguf: Path, out: Path) -> None:  # transformers' result, already made
        shutil.copytree(converted[1], out, dirs_exist_ok=True)

    with caplog.at_level(logging.INFO, logger="lorastream"):
        checkpoint = convert_gguf_file(tmp_path / "models", gguf_file, copy_conversion)
    kept = json.loads((checkpoint / SOURCE_FILE).read_text())  # what later starts log
    assert kept["tensor_types"] == {"Q8_0": MATRICES, "F32": NORMS}
    assert "converting" in caplog.text
    assert (f"Q8_0 x {MATRICES}: dequantized exactly; --quantization int8 holds it in 8 bits"
            in caplog.text)
    assert f"F32 x {NORMS}: its values" in caplog.text


@pytest.fixture
def engines(converted: tuple[Path, Path], gguf_file: Path
            ) -> Iterator[dict[str, Engine]]:
    cache = converted[0]
    built: dict[str, Engine] = {}

    def settings(mode: str) -> WorkerSettings:
        return WorkerSettings(model=str(gguf_file), served_model_name="tiny-gguf",
                              model_cache_dir=cache, quantization=mode, max_loras=2,
                              max_lora_rank=8, kv_cache_bytes=8 << 20)

    for mode in ("none", "int8"):
        built[mode] = build_engine(settings(mode)).start()
    yield built
    for engine in built.values():
        engine.stop()
        assert engine.healthy_after_stop()


def _greedy(engine: Engine, prompt: list[int]) -> list[int]:
    stream = engine.submit("tiny-gguf", PromptInput(token_ids=tuple(prompt)),
                           SamplingParams(max_tokens=NEW_TOKENS))
    return [t for event in stream for t in event.token_ids]


def test_the_gguf_model_serves_transformers_greedy_tokens_and_int8_holds_its_values(
    engines: dict[str, Engine], converted: tuple[Path, Path],
    gguf_file: Path,
) -> None:
    from transformers import AutoTokenizer, LlamaForCausalLM

    checkpoint = converted[1]
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prompt = tokenizer(PROMPT)["input_ids"]
    hf = LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    expected = reference_greedy(hf, prompt, NEW_TOKENS)
    assert len(expected) >= 4
    assert _greedy(engines["none"], prompt) == expected

    # int8: each projection holds the file's values requantized per output channel, within half
    # of its row's int8 step (the blocks of a row have different scales: not the file's ints)
    model = engines["int8"].model
    down = model.proj[1][3]
    assert isinstance(down, QuantLinear)
    file_values = torch.from_numpy(gguf_matrix(gguf_file, "blk.1.ffn_down.weight"))  # [H, I]
    held = dequantize(down.weight_q, down.scale)
    assert (held - file_values).abs().le(down.scale[:, None] / 2 * (1 + 1e-6)).all()
    assert not torch.equal(held, file_values)
    got = _greedy(engines["int8"], prompt)
    assert len(got) == len(expected)  # served; its agreement is test_quantization.py's


def test_a_file_named_gguf_that_is_not_one_is_refused_and_nothing_is_left(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + np.arange(40, dtype=np.uint8).tobytes())
    cache = tmp_path / "models"
    with pytest.raises(InvalidArgument, match=r"broken.gguf: not a GGUF file this worker can read"):
        resolve_checkpoint(str(bad), cache_dir=cache)
    assert not cache.exists() or not any(cache.iterdir())


def test_another_file_is_still_refused_as_a_file(tmp_path: Path) -> None:
    other = tmp_path / "model.bin"
    other.write_bytes(b"\0" * 16)
    with pytest.raises(InvalidArgument, match=r"is a file; pass the checkpoint directory .*gguf"):
        resolve_checkpoint(str(other), cache_dir=tmp_path / "models")


def test_a_gguf_of_an_architecture_transformers_cannot_read_is_refused_naming_why(
    tmp_path: Path,
) -> None:
    import gguf

    odd = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(odd, "not-a-family")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cache = tmp_path / "models"
    refused = r"odd.gguf: transformers could not convert this GGUF"
    with pytest.raises(InvalidArgument, match=refused):
        resolve_checkpoint(str(odd), cache_dir=cache)
    assert not [p for p in cache.iterdir() if not p.name.startswith(".")]  # no half checkpoint


@pytest.mark.parametrize("missing", ["accelerate", "gguf"])
def test_a_conversion_without_a_loader_package_says_what_to_install_in_one_line(
    gguf_file: Path, missing: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """transformers' GGUF loader imports accelerate and gguf itself; without one the first start
    would end in its traceback (what a fresh `make up` did while the runtime lock lacked
    accelerate). The conversion asks first, and leaves no half checkpoint."""
    monkeypatch.setitem(sys.modules, missing, None)  # as if not installed: find_spec -> None
    cache = tmp_path / "models"
    with pytest.raises(InvalidArgument, match=rf"needs {missing}, which is not installed: "
                                              r"pip install -r requirements.lock") as err:
        resolve_checkpoint(str(gguf_file), cache_dir=cache)
    assert "\n" not in str(err.value)
    assert not cache.exists() or not [p for p in cache.iterdir() if not p.name.startswith(".")]
