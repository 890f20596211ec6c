"""The engine with the Triton SGMV backend (run in Triton's interpreter on the CPU) gives the same
greedy tokens as with the torch backend, and as HF transformers + PEFT."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are first launched

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from lorastream.core.generation import PromptInput, SamplingParams  # noqa: E402
from lorastream.worker.service.operations import WorkerOperations  # noqa: E402
from tests.worker.conftest import ADAPTERS, PROMPTS, EngineFactory  # noqa: E402

NEW_TOKENS = 6


def _run(engine_factory: EngineFactory, backend: str, adapters: dict[str, Path]) -> dict:  # type: ignore[type-arg]
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
                            timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert "refused: --lora-backend triton cannot run here" in result.stdout, result.stderr
    assert "TRITON_INTERPRET=1" in result.stdout
