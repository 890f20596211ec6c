"""Incremental detokenization: streamed deltas add up to ``tokenizer.decode`` of the generated ids
(multi-byte characters split over byte tokens, SentencePiece leading spaces), and stop strings
that span tokens cut the output just before them (OpenAI semantics).

Two tokenizers are trained locally (no network) on a corpus with é, 中文 and emoji: a byte-level
BPE (GPT-2 style) and a Metaspace BPE with byte fallback (Llama style, <0xE4> tokens)."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from lorastream.core.errors import InvalidArgument
from lorastream.worker.engine.detokenizer import MAX_HELD_TOKENS, IncrementalDetokenizer

CORPUS = [
    "Héllo wörld, café crème brûlée. 中文测试，你好世界！",
    "Emoji 😀🎉👍🏽 ok.",
    "The quick brown fox jumps over the lazy dog.\nNew line here.",
    "naïve façade — «quotes» 日本語 テキスト 한국어 ",
    "def f(x):\n    return x * 2  # 🐍",
] * 20
CHARS = ["é", "中", "文", "😀", "ü", "\n", "A", "🎉", "한", " "]  # spelt with byte tokens
EXTRA_PIECES = ["▁Hello", "▁world", "!"]  # fixed Metaspace tokens for the hand-written cases


def byte_level_bpe() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>"],
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")


def metaspace_byte_fallback_bpe() -> PreTrainedTokenizerFast:
    """SentencePiece-style: ▁ for spaces, <0xXX> tokens for characters outside the vocabulary."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=60
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    spec = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    for piece in [f"<0x{b:02X}>" for b in range(256)] + EXTRA_PIECES:
        vocab.setdefault(piece, len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        unk_token="<unk>", bos_token="<s>", eos_token="</s>",
    )


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, PreTrainedTokenizerFast]:
    return {"byte-level": byte_level_bpe(), "metaspace": metaspace_byte_fallback_bpe()}


@pytest.fixture(scope="module")
def metaspace(tokenizers: dict[str, PreTrainedTokenizerFast]) -> PreTrainedTokenizerFast:
    return tokenizers["metaspace"]


def random_ids(tokenizer: PreTrainedTokenizerFast, kind: str, rng: random.Random) -> list[int]:
    """Byte-level: any ids at all. Metaspace: ordinary tokens, special tokens and characters
    spelt as whole <0xXX> runs (an invalid run is the documented exception, tested apart)."""
    length = rng.randint(1, 40)
    if kind == "byte-level":
        return [rng.randrange(len(tokenizer)) for _ in range(length)]
    pieces = [t for t in tokenizer.get_vocab() if not t.startswith("<")]
    ids: list[int] = []
    while len(ids) < length:
        roll = rng.random()
        if roll < 0.55:
            ids.append(tokenizer.convert_tokens_to_ids(rng.choice(pieces)))
        elif roll < 0.9:
            utf8 = rng.choice(CHARS).encode()
            ids.extend(tokenizer.convert_tokens_to_ids([f"<0x{b:02X}>" for b in utf8]))
        else:
            ids.append(rng.choice(tokenizer.all_special_ids))
    return ids


def stream(
    tokenizer: Any, ids: Sequence[int], stop: Sequence[str] = (), **kwargs: Any
) -> tuple[list[str], str, IncrementalDetokenizer]:
    """(delta per token, flush(), the detokenizer)."""
    detokenizer = IncrementalDetokenizer(tokenizer, [1, 2, 3], stop=stop, **kwargs)
    deltas = [detokenizer.push(i).delta for i in ids]
    return deltas, detokenizer.flush(), detokenizer


def cut_at_first_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """Reference: feed characters one at a time; cut before the first stop string completed."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stop if text[:end].endswith(s)]
        if hits:
            return text[: end - max(map(len, hits))], True
    return text, False


@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
def test_deltas_and_flush_add_up_to_decode_of_the_generated_ids(
    tokenizers: dict[str, PreTrainedTokenizerFast], kind: str
) -> None:
    tokenizer, rng = tokenizers[kind], random.Random(f"deltas-{kind}")
    for _ in range(200):
        ids = random_ids(tokenizer, kind, rng)
        deltas, tail, detokenizer = stream(tokenizer, ids)
        expected = tokenizer.decode(ids, skip_special_tokens=True)
        assert "".join(deltas) + tail == detokenizer.text == expected, ids
        assert not detokenizer.stopped


@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
def test_stop_strings_cut_the_output_just_before_the_first_one(
    tokenizers: dict[str, PreTrainedTokenizerFast], kind: str
) -> None:
    tokenizer, rng = tokenizers[kind], random.Random(f"stop-{kind}")
    stops_hit = 0
    for _ in range(200):
        ids = random_ids(tokenizer, kind, rng)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if not text:
            continue
        stop = ["never-in-the-text"]
        for _ in range(rng.randint(1, 3)):
            start = rng.randrange(len(text))
            stop.append(text[start : start + rng.randint(1, 6)])
        detokenizer = IncrementalDetokenizer(tokenizer, [], stop=stop)
        steps = [detokenizer.push(i) for i in ids]
        tail = detokenizer.flush()
        expected, stopped = cut_at_first_stop(text, stop)
        assert "".join(s.delta for s in steps) + tail == detokenizer.text == expected, (ids, stop)
        assert detokenizer.stopped == stopped
        if stopped:
            stops_hit += 1
            first = next((n for n, s in enumerate(steps) if s.stopped), len(steps))  # or flush
            assert all(s.stopped and not s.delta for s in steps[first + 1 :])
            assert not tail or first == len(steps)
    assert stops_hit > 150


def test_multibyte_character_split_over_byte_tokens_is_released_whole(
    metaspace: PreTrainedTokenizerFast,
) -> None:
    ids = metaspace.convert_tokens_to_ids(["▁Hello", "<0xE4>", "<0xB8>", "<0xAD>", "▁world"])
    deltas, tail, _ = stream(metaspace, ids)
    assert deltas == ["Hello", "", "", "中", " world"] and tail == ""


def test_sentencepiece_leading_space_is_dropped_at_the_start_and_kept_between_tokens(
    metaspace: PreTrainedTokenizerFast,
) -> None:
    ids = metaspace.convert_tokens_to_ids(["▁", "▁Hello", "▁", "▁world", "!", "▁Hello"])
    deltas, tail, _ = stream(metaspace, ids)
    assert deltas == ["", " Hello", " ", " world", "!", " Hello"] and tail == ""
    assert "".join(deltas) == metaspace.decode(ids)


@pytest.mark.parametrize(
    ("stop", "deltas", "tail", "stopped"),
    [
        (["xyz"], ["Hello", " world", "!"], "", False),
        (["o w"], ["Hell", ""], "", True),  # spans two tokens
        (["world!"], ["Hello", " ", ""], "", True),  # " world" holds "world" back
        (["!", "ld"], ["Hello", " wor"], "", True),
        (["d!!"], ["Hello", " worl", ""], "d!", False),  # a held prefix is released by flush
        (["Hello"], [""], "", True),
        (["lo", "Hello w"], ["Hel"], "", True),  # "lo" completes before "Hello w"
    ],
)
def test_stop_string_table(
    metaspace: PreTrainedTokenizerFast,
    stop: list[str],
    deltas: list[str],
    tail: str,
    stopped: bool,
) -> None:
    ids = metaspace.convert_tokens_to_ids(["▁Hello", "▁world", "!"])
    detokenizer = IncrementalDetokenizer(metaspace, [], stop=stop)
    steps = [detokenizer.push(i) for i in ids]
    assert [s.delta for s in steps][: len(deltas)] == deltas
    assert all(s.delta == "" for s in steps[len(deltas) :])
    assert detokenizer.flush() == tail
    assert detokenizer.stopped == stopped == steps[-1].stopped


@pytest.mark.parametrize(
    ("kind", "pieces"),
    [
        ("metaspace", ["▁Hello", "<0xE4>", "<0xB8>"]),
        ("metaspace", ["<0xF0>", "<0x9F>", "<0x98>"]),
        ("byte-level", ["H", "ä¸"]),  # E4 B8 of 中 in GPT-2's byte alphabet
    ],
)
def test_incomplete_utf8_at_the_end_is_held_then_flushed_as_the_tokenizer_renders_it(
    tokenizers: dict[str, PreTrainedTokenizerFast], kind: str, pieces: list[str]
) -> None:
    tokenizer = tokenizers[kind]
    ids = tokenizer.convert_tokens_to_ids(pieces)
    assert None not in ids
    deltas, tail, _ = stream(tokenizer, ids)
    assert deltas[-1] == "" and tail.endswith("\ufffd")
    assert "".join(deltas) + tail == tokenizer.decode(ids)


def test_valid_bytes_before_an_invalid_byte_fallback_run_are_kept(
    metaspace: PreTrainedTokenizerFast,
) -> None:
    """The documented exception: ByteFallback renders <0x0A><0xE4> as two U+FFFD, losing a
    newline that was valid (and already streamed) when it arrived."""
    ids = metaspace.convert_tokens_to_ids(["▁Hello", "<0x0A>", "<0xE4>"])
    deltas, tail, _ = stream(metaspace, ids)
    assert deltas == ["Hello", "\n", ""] and tail == "\ufffd"
    assert metaspace.decode(ids) == "Hello\ufffd\ufffd"


def test_special_tokens_are_rendered_when_not_skipped(metaspace: PreTrainedTokenizerFast) -> None:
    ids = metaspace.convert_tokens_to_ids(["▁Hello", "</s>", "▁world"])
    deltas, tail, _ = stream(metaspace, ids, skip_special_tokens=False)
    assert "".join(deltas) + tail == metaspace.decode(ids) == "Hello</s> world"


class DecodeSpy:
    """A tokenizer that records how many ids each decode call was given."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        self.tokenizer = tokenizer
        self.sizes: list[int] = []

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False, **kwargs: Any) -> str:
        self.sizes.append(len(token_ids))
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)


@pytest.mark.parametrize(
    ("kind", "pieces"),
    [
        ("metaspace", ["▁Hello", "<0xE4>", "<0xB8>", "<0xAD>", "▁world", "</s>"]),
        ("metaspace", ["<0x80>"]),  # garbage that never renders cleanly: forced releases
        ("byte-level", ["H", "ä¸", "Ńæĸ", "ĩ", "Ġcaf", "Ã©"]),  # 中文 café
    ],
)
def test_each_token_decodes_a_bounded_window_however_long_the_output(
    tokenizers: dict[str, PreTrainedTokenizerFast], kind: str, pieces: list[str]
) -> None:
    tokenizer = tokenizers[kind]
    ids = tokenizer.convert_tokens_to_ids(pieces) * (1000 // len(pieces))
    assert None not in ids
    spy = DecodeSpy(tokenizer)
    deltas, tail, _ = stream(spy, ids)
    assert max(spy.sizes) <= 2 * MAX_HELD_TOKENS
    assert len(spy.sizes) <= 2 * len(ids) + 2
    assert "".join(deltas) + tail == tokenizer.decode(ids, skip_special_tokens=True)


def test_after_a_stop_nothing_more_is_released(metaspace: PreTrainedTokenizerFast) -> None:
    world = metaspace.convert_tokens_to_ids("▁world")
    detokenizer = IncrementalDetokenizer(metaspace, [], stop=["world"])
    assert detokenizer.push(world).stopped
    assert [detokenizer.push(world).delta for _ in range(3)] == ["", "", ""]
    assert detokenizer.flush() == "" and detokenizer.text == ""


def test_push_after_flush_is_a_programming_error(metaspace: PreTrainedTokenizerFast) -> None:
    detokenizer = IncrementalDetokenizer(metaspace, [])
    detokenizer.push(metaspace.convert_tokens_to_ids("▁Hello"))
    assert detokenizer.flush() == "" and detokenizer.flush() == ""
    with pytest.raises(RuntimeError, match="after flush"):
        detokenizer.push(0)


@pytest.mark.parametrize(
    ("stop", "message"),
    [(["ok", ""], "must not be empty"), ("END", "got a single string")],
)
def test_bad_stop_strings_raise_invalid_argument(
    metaspace: PreTrainedTokenizerFast, stop: Any, message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        IncrementalDetokenizer(metaspace, [], stop=stop)
