"""An adapter's own tokenizer (core/adapter_tokenizer.py): the store keeps it in the content id,
the worker encodes that adapter's prompts and decodes its output with it, and a tokenizer with
more ids than the base model's embedding rows is refused.

A tiny Qwen2 (tied lm_head, so new embedding rows reach the logits) and an adapter trained by
PEFT with TrainableTokens on id 200, shipped with a tokenizer that renames that reserved id to
the added token ``<tool>``; its greedy tokens must be transformers + PEFT's on the prompt its
tokenizer encodes, the new token among them, its text ``<tool>``. The same adapter with
``<tool>`` as its end of turn (its tokenizer's EOS, or its generation config's eos_token_id)
stops there, as ``generate`` with those stop ids does; a structured output of its request is
compiled for its tokenizer, where ``<tool>`` is one token.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lorastream.core.adapter_validation import content_id
from lorastream.core.errors import InvalidAdapter, InvalidArgument
from lorastream.core.generation import FinishReason, PromptInput
from lorastream.core.store_client import StoreClient
from lorastream.core.structured import StructuredKind, StructuredOutput
from lorastream.store.config import StoreSettings
from lorastream.store.server import create_server as create_store
from lorastream.worker.engine.engine import Engine
from lorastream.worker.engine.sampling import SamplingParams
from lorastream.worker.service.bootstrap import build_engine
from lorastream.worker.service.config import WorkerSettings
from tests.support.families import BASE, reference_model
from tests.support.models import make_tiny_family, make_vocab_adapter, save_adapter_tokenizer

NEW = 200  # the reserved id the adapter's tokenizer names <tool>
TEXTS = ["ab<tool>cd", "hello <tool> x"]
NEW_TOKENS = 8


@dataclass(frozen=True)
class Case:
    checkpoint: Path
    adapter: Path
    reference: dict[tuple[str, int], list[int]]  # (model, text index) -> greedy tokens


def _greedy(checkpoint: Path, adapter: Path | None, tokenizer_dir: Path,
            eos: list[int] | None = None) -> dict[int, list[int]]:
    """Greedy tokens of transformers (+ PEFT) per text; ``eos``: the stop ids to generate with
    (default the model's generation config's)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    model = reference_model(checkpoint, adapter)
    stop = {} if eos is None else {"eos_token_id": eos}
    out = {}
    with torch.no_grad():
        for i, text in enumerate(TEXTS):
            ids = tokenizer(text).input_ids
            tokens = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                    dtype=torch.long), max_new_tokens=NEW_TOKENS, do_sample=False,
                                    **stop)
            out[i] = tokens[0, len(ids):].tolist()
    return out


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> Case:
    root = tmp_path_factory.mktemp("adapter-tokenizer")
    checkpoint = make_tiny_family("qwen2", root / "model")
    for seed in range(20):  # new rows drawn at random: take one whose token the model emits
        adapter = make_vocab_adapter(checkpoint, root / f"tool-{seed}", rank=4, seed=seed,
                                     target_modules=["q_proj"], trainable_token_indices=[NEW])
        save_adapter_tokenizer(checkpoint, adapter, {NEW: "<tool>"})
        tool = _greedy(checkpoint, adapter, adapter)
        if any(NEW in tool[i][1:] for i in tool):
            break
    else:
        raise AssertionError("no seed made the adapter emit its new token")
    base = _greedy(checkpoint, None, checkpoint)
    reference = {**{("tool", i): t for i, t in tool.items()},
                 **{(BASE, i): t for i, t in base.items()}}
    return Case(checkpoint, adapter, reference)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[str]:
    server, port, _ = create_store(StoreSettings(port=0, cache_dir=tmp_path / "store"))
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None).wait()


def _preload(store: str, path: Path, name: str) -> None:
    with StoreClient(store) as client:
        for _ in client.preload(str(path), name):
            pass


def _engine(case: Case, store: str, tmp_path: Path, prefix_caching: bool) -> Engine:
    settings = WorkerSettings(
        model=str(case.checkpoint), served_model_name=BASE, port=0, store=store, max_loras=2,
        max_lora_rank=8, kv_cache_bytes=4 << 20, model_cache_dir=tmp_path / "models",
        prefix_caching=prefix_caching,
    )
    return build_engine(settings, checkpoint=case.checkpoint)


def test_the_store_keeps_the_tokenizer_in_the_content_id(case: Case, store: str,
                                                         tmp_path: Path) -> None:
    _preload(store, case.adapter, "tool")
    with StoreClient(store) as client:
        manifest = client.describe("tool")
        assert [f.name for f in manifest.files] == ["tokenizer.json", "tokenizer_config.json"]
        assert manifest.tokenizer_vocab == 256 and manifest.adapter_id == content_id(case.adapter)
        data = client.read_file("tool", manifest.adapter_id, "tokenizer.json")
        assert data == (case.adapter / "tokenizer.json").read_bytes()
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (bare / name).write_bytes((case.adapter / name).read_bytes())
    assert content_id(bare) != manifest.adapter_id  # the tokenizer is part of the content


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-cache"])
def test_an_adapter_with_new_tokens_encodes_and_decodes_with_its_tokenizer(
    case: Case, store: str, tmp_path: Path, prefix_caching: bool
) -> None:
    """The adapter and the base model, same texts, one batch, twice: each encoded with its own
    tokenizer, greedy tokens PEFT's, the new token decoded as ``<tool>``."""
    _preload(store, case.adapter, "tool")
    engine = _engine(case, store, tmp_path, prefix_caching)
    try:
        for round_ in range(2):
            streams = {(model, i): engine.submit(model, PromptInput(text=text),
                                                 SamplingParams(max_tokens=NEW_TOKENS))
                       for model in ("tool", BASE) for i, text in enumerate(TEXTS)}
            if round_ == 0:
                engine.start()
            for key, stream in streams.items():
                events = list(stream)
                tokens = [t for e in events for t in e.token_ids]
                assert tokens == case.reference[key], (key, round_)
                text = "".join(e.text for e in events)
                assert ("<tool>" in text) is (NEW in tokens), (key, text)
            assert any(NEW in case.reference[("tool", i)] for i in range(len(TEXTS)))
        tool = engine.tokenizer_for("tool")
        assert tool.decode([NEW]) == "<tool>" != engine.tokenizer_for(BASE).decode([NEW])
    finally:
        engine.stop()


def test_a_tokenizer_beyond_the_embedding_rows_is_refused(
    case: Case, store: str, tmp_path: Path
) -> None:
    """Added tokens on ids past the embedding: the store refuses the adapter whose own tensors
    tell the vocabulary (a saved embedding); a worker refuses one whose tensors do not."""
    grown = {256 + i: f"<new{i}>" for i in range(3)}
    saved = make_vocab_adapter(case.checkpoint, tmp_path / "saved", rank=4, seed=1,
                               target_modules=["q_proj"], modules_to_save=["embed_tokens"])
    tokens = make_vocab_adapter(case.checkpoint, tmp_path / "tokens", rank=4, seed=1,
                                target_modules=["q_proj"], trainable_token_indices=[NEW])
    for path in (saved, tokens):
        _grow(case.checkpoint, path, grown)
    with pytest.raises(InvalidArgument, match=r"259 token ids but .* has 256 embedding rows"):
        _preload(store, saved, "saved")
    _preload(store, tokens, "tokens")
    engine = _engine(case, store, tmp_path, True)
    try:
        with pytest.raises(InvalidAdapter, match="mismatched vocabulary"):
            engine.submit("tokens", PromptInput(text="ab"), SamplingParams(max_tokens=2))
    finally:
        engine.stop()


def _grow(base: Path, out: Path, tokens: dict[int, str]) -> None:
    """The base tokenizer with ``tokens`` added past its last id."""
    import json

    doc = json.loads((base / "tokenizer.json").read_text())
    for token_id, text in tokens.items():
        doc["model"]["vocab"][text] = token_id
        doc["added_tokens"].append({"id": token_id, "content": text, "single_word": False,
                                    "lstrip": False, "rstrip": False, "normalized": False,
                                    "special": False})
    (out / "tokenizer.json").write_text(json.dumps(doc))


def _end_of_turn_adapter(case: Case, out: Path, how: str) -> Path:
    """``case.adapter`` with ``<tool>`` as its end of turn: its tokenizer's EOS ("tokenizer"),
    or its generation config's eos_token_id ("generation-config")."""
    shutil.copytree(case.adapter, out)
    if how == "tokenizer":
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            if (out / name).exists():
                doc = json.loads((out / name).read_text())
                doc["eos_token"] = "<tool>"
                (out / name).write_text(json.dumps(doc))
    else:
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [NEW]}))
    return out


def _model_eos(checkpoint: Path) -> list[int]:
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(str(checkpoint)).eos_token_id
    except OSError:  # no generation_config.json: config.json's
        eos = json.loads((checkpoint / "config.json").read_text()).get("eos_token_id")
    return [] if eos is None else list(eos) if isinstance(eos, list) else [eos]


@pytest.mark.parametrize("how", ["tokenizer", "generation-config"])
def test_an_adapter_stops_on_its_own_end_of_turn_token(
    case: Case, store: str, tmp_path: Path, how: str
) -> None:
    """The adapter's requests stop on ``<tool>`` as transformers' generate does with its stop
    ids: its generation config's (else the base model's) and its tokenizer's EOS; the base
    model's requests in the same batch do not."""
    from transformers import AutoTokenizer

    adapter = _end_of_turn_adapter(case, tmp_path / "eot", how)
    own = AutoTokenizer.from_pretrained(str(adapter))
    model_eos = [NEW] if how == "generation-config" else _model_eos(case.checkpoint)
    eos = sorted({*model_eos, int(own.eos_token_id)})
    assert NEW in eos
    reference = _greedy(case.checkpoint, adapter, adapter, eos=eos)
    stopped = [i for i, t in reference.items() if t[-1] == NEW]
    assert stopped and all(len(reference[i]) < NEW_TOKENS for i in stopped)
    _preload(store, adapter, "eot")
    engine = _engine(case, store, tmp_path, True)
    try:
        streams = {(model, i): engine.submit(model, PromptInput(text=text),
                                             SamplingParams(max_tokens=NEW_TOKENS))
                   for model in ("eot", BASE) for i, text in enumerate(TEXTS)}
        engine.start()
        for (model, i), stream in streams.items():
            events = list(stream)
            tokens = [t for e in events for t in e.token_ids]
            want = reference[i] if model == "eot" else case.reference[(BASE, i)]
            assert tokens == want, (model, i)
            if model == "eot" and i in stopped:
                assert events[-1].finish_reason is FinishReason.STOP
    finally:
        engine.stop()


def test_a_structured_output_is_compiled_for_the_adapter_tokenizer(
    case: Case, store: str, tmp_path: Path
) -> None:
    """A regex that starts with ``<tool>``: for the adapter, its one token (id 200) may open
    the output; for the base model, whose id 200 is another text, it may not. The adapter's
    constrained request ends with text that matches the regex."""
    _preload(store, case.adapter, "tool")
    engine = _engine(case, store, tmp_path, True)
    regex = StructuredOutput(StructuredKind.REGEX, "<tool>[a-z]{1,3}", "regex")
    params = SamplingParams(max_tokens=NEW_TOKENS, structured=regex)
    try:
        own = engine.adapters.tokenizer(engine.adapters.resolve("tool"))
        assert own is not None
        first = {}
        for label, tokenizer in (("tool", own), (BASE, None)):
            matcher = engine.intake.matcher(params, tokenizer)
            assert matcher is not None
            row = torch.zeros(engine.intake.masks.words, dtype=torch.int32)  # [W]
            matcher.fill(row)
            first[label] = bool((int(row[NEW // 32]) >> (NEW % 32)) & 1)
        assert first == {"tool": True, BASE: False}
        assert engine.intake.grammar_for(own) is engine.intake.grammar_for(own)  # compiled once
        stream = engine.submit("tool", PromptInput(text=TEXTS[0]), params)
        engine.start()
        events = list(stream)
        text = "".join(e.text for e in events)
        assert re.fullmatch(r"<tool>[a-z]{1,3}", text), text
        assert events[-1].finish_reason is FinishReason.STOP
    finally:
        engine.stop()
