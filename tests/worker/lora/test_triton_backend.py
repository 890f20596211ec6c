"""The engine with the Triton SGMV backend (run in Triton's interpreter on the CPU) gives the same
greedy tokens as with the torch backend, and as HF transformers + PEFT."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are first launched

from pathlib import Path

import pytest

from lorastream.core.generation import PromptInput, SamplingParams
from lorastream.worker.service.operations import WorkerOperations
from tests.worker.conftest import ADAPTERS, PROMPTS, EngineFactory

NEW_TOKENS = 6


def _run(engine_factory: EngineFactory, backend: str, adapters: dict[str, Path]) -> dict:
    engine = engine_factory(start=False, lora_backend=backend)
    ops = WorkerOperations(engine)
    for name, path in adapters.items():
        ops.load_adapter(name, str(path))
    streams = {
        (name, i): engine.submit(name, PromptInput(token_ids=tuple(p)),
                                 SamplingParams(max_tokens=NEW_TOKENS))
        for name in ["tiny", *ADAPTERS] for i, p in enumerate(PROMPTS[:2])
    }
    engine.start()
    return {key: [t for e in s for t in e.token_ids] for key, s in streams.items()}


def test_triton_backend_gives_the_torch_backends_greedy_tokens(
    engine_factory: EngineFactory,
    tiny_adapters: dict[str, Path],
    reference: dict[tuple[str, int], list[int]],
) -> None:
    pytest.importorskip("triton")
    torch_tokens = _run(engine_factory, "torch", tiny_adapters)
    triton_tokens = _run(engine_factory, "triton", tiny_adapters)
    assert triton_tokens == torch_tokens
    for (name, i), tokens in triton_tokens.items():
        assert tokens == reference[("base" if name == "tiny" else name, i)][:NEW_TOKENS]


def test_triton_backend_serves_phi3s_fused_targets_as_peft_does(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """qkv_proj and gate_up_proj: one LoRA over a fused projection's whole output."""
    pytest.importorskip("triton")
    from lorastream.worker.service.bootstrap import build_engine
    from lorastream.worker.service.config import WorkerSettings
    from tests.support import families

    case = families.make_family_case("phi3", tmp_path_factory.mktemp("phi3"))
    engine = build_engine(WorkerSettings(
        model=str(case.checkpoint), served_model_name=families.BASE, max_loras=3,
        max_lora_rank=16, kv_cache_bytes=1 << 20, lora_backend="triton",
        model_cache_dir=tmp_path_factory.mktemp("models"),
    ), checkpoint=case.checkpoint)
    ops = WorkerOperations(engine)
    for name, path in case.adapters.items():
        ops.load_adapter(name, str(path))
    streams = {
        (name, i): engine.submit(name, PromptInput(token_ids=tuple(p)),
                                 SamplingParams(max_tokens=NEW_TOKENS))
        for name in [families.BASE, *case.adapters] for i, p in enumerate(families.PROMPTS[:2])
    }
    engine.start()
    try:
        for (name, i), stream in streams.items():
            tokens = [t for e in stream for t in e.token_ids]
            assert tokens == case.reference[(name, i)][:NEW_TOKENS], (name, i)
    finally:
        engine.stop()


def test_triton_backend_on_a_cpu_without_the_interpreter_is_refused_at_startup() -> None:
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import torch\n"
        "from lorastream.core.errors import InvalidArgument\n"
        "from lorastream.worker.lora.triton_backend import TritonLoraBackend\n"
        "try:\n"
        "    TritonLoraBackend(torch.float32, torch.device('cpu'))\n"
        "except InvalidArgument as err:\n"
        "    print('refused:', err)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                            timeout=120, cwd=Path(__file__).resolve().parents[3])
    assert "refused: --lora-backend triton cannot run here" in result.stdout, result.stderr
    assert "TRITON_INTERPRET=1" in result.stdout
