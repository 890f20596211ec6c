"""Fixtures for the worker tests: a tiny random Llama, PEFT adapters made on it, and the
HF transformers + PEFT reference that the engine must match token for token."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

from lorastream.core.generation import PromptInput, SamplingParams
from lorastream.core.store_client import StoreClient
from lorastream.store.config import StoreSettings
from lorastream.store.server import create_server as create_store
from lorastream.worker.engine.engine import Engine
from lorastream.worker.service.bootstrap import build_engine
from lorastream.worker.service.config import WorkerSettings
from tests.support.models import ALL_LINEAR, ATTENTION, MLP, make_peft_adapter, make_tiny_checkpoint


@dataclass(frozen=True)
class AdapterSpec:
    rank: int
    targets: list[str] | str
    use_rslora: bool = False
    seed: int = 1


# Ranks 4-64; attention only, MLP only, all linear; one rsLoRA: the tests' matrix.
ADAPTERS: dict[str, AdapterSpec] = {
    "attn-r4": AdapterSpec(4, ATTENTION, seed=11),
    "mlp-r8": AdapterSpec(8, MLP, seed=12),
    "all-r16-rslora": AdapterSpec(16, ALL_LINEAR, use_rslora=True, seed=13),
    "all-r64": AdapterSpec(64, "all-linear", seed=14),
}
PROMPTS: list[list[int]] = [
    [5, 9, 33, 41, 7, 100, 3],
    [64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82],
    [200, 17],
]
NEW_TOKENS = 12


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


def make_tiny_adapters(model: Path, root: Path) -> dict[str, Path]:
    """The :data:`ADAPTERS` as real PEFT adapters on ``model``, under ``root``."""
    return {
        name: make_peft_adapter(
            model, root / name, rank=s.rank, targets=s.targets, use_rslora=s.use_rslora,
            seed=s.seed, b_std=0.2,
        )
        for name, s in ADAPTERS.items()
    }


@pytest.fixture(scope="session")
def tiny_adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_tiny_adapters(tiny_model, tmp_path_factory.mktemp("tiny-adapters"))


def peft_model(base_dir: Path, adapter_dir: Path | None) -> torch.nn.Module:
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    return base if adapter_dir is None else PeftModel.from_pretrained(base, adapter_dir).eval()


def reference_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    """HF greedy generation of up to ``new_tokens`` (stops at eos), generated ids only."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="session")
def reference(
    tiny_model: Path, tiny_adapters: dict[str, Path]
) -> dict[tuple[str, int], list[int]]:
    """(adapter name or "base", prompt index) -> HF + PEFT greedy tokens."""
    refs: dict[tuple[str, int], list[int]] = {}
    for name in ["base", *ADAPTERS]:
        model = peft_model(tiny_model, None if name == "base" else tiny_adapters[name])
        for i, prompt in enumerate(PROMPTS):
            refs[(name, i)] = reference_greedy(model, prompt, NEW_TOKENS)
    return refs


EngineFactory = Callable[..., Engine]


@pytest.fixture
def engine_factory(tiny_model: Path, tmp_path: Path) -> Iterator[EngineFactory]:
    """Started engines on the tiny model; stopped at teardown."""
    engines: list[Engine] = []

    def make(start: bool = True, **overrides: object) -> Engine:
        settings = WorkerSettings(
            model=str(tiny_model),
            served_model_name="tiny",
            model_cache_dir=tmp_path / "models",
            max_loras=overrides.pop("max_loras", 6),
            max_lora_rank=overrides.pop("max_lora_rank", 64),
            kv_cache_bytes=overrides.pop("kv_cache_bytes", 8 << 20),
            **overrides,
        )
        engine = build_engine(settings, checkpoint=tiny_model)
        if start:
            engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.stop()
        assert engine.healthy_after_stop(), "slots, references or KV blocks leaked"


@dataclass
class StoreStack:
    target: str
    port: int
    cache: Path
    server: grpc.Server

    def restart(self, chunk_delay_s: float = 0.0) -> None:
        """Stop the store and start it again on the same port and cache (the same content)."""
        self.server.stop(None).wait()
        settings = StoreSettings(
            port=self.port, cache_dir=self.cache, stream_chunk_delay_s=chunk_delay_s
        )
        server, _, _ = create_store(settings)
        server.start()
        self.server = server


@pytest.fixture
def store(tiny_adapters: dict[str, Path], tmp_path: Path) -> Iterator[StoreStack]:
    yield from staged_store(tmp_path / "store", tiny_adapters)


def staged_store(cache: Path, adapters: dict[str, Path]) -> Iterator[StoreStack]:
    """A store on loopback over ``cache`` with ``adapters`` (name -> PEFT dir) preloaded,
    stopped when the generator is closed (a fixture's body)."""
    server, port, _ = create_store(StoreSettings(port=0, cache_dir=cache))
    server.start()
    stack = StoreStack(f"127.0.0.1:{port}", port, cache, server)
    with StoreClient(stack.target) as client:
        for name, path in adapters.items():
            for _ in client.preload(str(path), name):
                pass
    yield stack
    stack.server.stop(None).wait()


def busy(seconds: float) -> None:
    """Spin on the CPU for ``seconds`` (a stand-in for a step's or a copy's work)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def greedy_tokens(engine: Engine, model: str, prompt: int, **params: object) -> list[int]:
    """The tokens ``engine`` generates for ``PROMPTS[prompt]`` (12 unless ``max_tokens``)."""
    sampling = SamplingParams(**{"max_tokens": 12, **params})  # type: ignore[arg-type]  # params: SamplingParams' own fields
    stream = engine.submit(model, PromptInput(token_ids=tuple(PROMPTS[prompt])), sampling)
    return [t for event in stream for t in event.token_ids]
