"""The worker's Tokenize and Detokenize RPCs on a real gRPC server on port 0:
the ids are the ones generation prefills, and detokenize inverts tokenize."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tokenizers import Tokenizer, processors

from lorastream.core import errors
from lorastream.core.generation import PromptInput, SamplingParams
from lorastream.core.tokenization import TokenizeInput
from lorastream.core.worker_client import WorkerClient
from lorastream.worker.engine.engine import Engine
from lorastream.worker.service.bootstrap import build_engine
from lorastream.worker.service.config import WorkerSettings
from lorastream.worker.service.server import create_server

BOS = 1
CHAT = (("system", "Be brief."), ("user", "Hi there"))


@dataclass
class Worker:
    target: str
    engine: Engine


@pytest.fixture(scope="module")
def bos_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a tokenizer that adds BOS (as Llama's does), so that
    ``add_special_tokens`` changes something."""
    path = tmp_path_factory.mktemp("bos") / "model"
    shutil.copytree(tiny_model, path)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", BOS)]
    )
    tokenizer.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def worker(bos_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    settings = WorkerSettings(
        model=str(bos_model), served_model_name="tiny", port=0, max_loras=2,
        kv_cache_bytes=8 << 20, model_cache_dir=tmp_path_factory.mktemp("models"),
    )
    server, port, engine = create_server(settings, build_engine(settings, checkpoint=bos_model))
    server.start()
    yield Worker(f"127.0.0.1:{port}", engine)
    server.stop(None).wait()
    engine.stop()


@pytest.mark.parametrize("prompt", [
    PromptInput(text="Hello, world"),
    PromptInput(messages=CHAT),
], ids=["text", "chat"])
def test_tokenize_gives_the_ids_generation_prefills(worker: Worker, prompt: PromptInput) -> None:
    chat = prompt.messages is not None
    request = TokenizeInput(prompt, add_generation_prompt=True, add_special_tokens=not chat)
    with WorkerClient(worker.target) as client:
        tokenized = client.tokenize(request)
        events = list(client.generate("tiny", prompt, SamplingParams(max_tokens=1)))
    assert list(tokenized.tokens) == worker.engine.tokenize(prompt)
    assert len(tokenized.tokens) == events[-1].prompt_tokens
    assert tokenized.max_model_len == worker.engine.intake.max_seq_len
    assert tokenized.token_strs is None


@pytest.mark.parametrize(("request_", "expected"), [
    (TokenizeInput(PromptInput(text="ab")), "<s>ab"),
    (TokenizeInput(PromptInput(text="ab"), add_special_tokens=False), "ab"),
    (TokenizeInput(PromptInput(messages=CHAT), add_special_tokens=False),
     "<system>Be brief.<user>Hi there<assistant>"),
    (TokenizeInput(PromptInput(messages=CHAT), add_generation_prompt=False,
                   add_special_tokens=False), "<system>Be brief.<user>Hi there"),
], ids=["text", "text-no-bos", "chat", "chat-no-generation-prompt"])
def test_detokenize_inverts_tokenize(
    worker: Worker, request_: TokenizeInput, expected: str
) -> None:
    with WorkerClient(worker.target) as client:
        tokens = client.tokenize(request_).tokens
        assert (tokens[0] == BOS) is expected.startswith("<s>")
        assert client.detokenize(list(tokens)) == expected


def test_token_strings_come_one_per_token(worker: Worker) -> None:
    request = TokenizeInput(PromptInput(text="a b"), return_token_strs=True)
    with WorkerClient(worker.target) as client:
        tokenized = client.tokenize(request)
    assert tokenized.token_strs == ("<s>", "a", " ", "b")
    assert len(tokenized.tokens) == 4


@pytest.mark.parametrize("tokens", [[-1], [5, 1 << 20]], ids=["negative", "past-vocab"])
def test_detokenize_refuses_ids_outside_the_vocabulary(worker: Worker, tokens: list[int]) -> None:
    with WorkerClient(worker.target) as client, pytest.raises(
        errors.InvalidArgument, match="outside the vocabulary"
    ):
        client.detokenize(tokens)
