"""docs/design.md rule 3 on CUDA: nothing on the step path forces a host-device sync.

``torch.cuda.set_sync_debug_mode("error")`` makes every synchronizing CUDA call raise (a
``.item()``, a read back to the host, a pageable copy, a ``synchronize``). It is on for the whole
engine step -- slot events, metadata staging and its copy, the LoRA metadata, the forward, the
compute event, the sampler -- and off only for the step's one transfer to the host, the sampled
tokens (``step_sampling.sample_step``: ``sampled.tokens.tolist()``).
tests/worker/model/test_step_sync_free.py checks the same path on the CPU by forbidding the Tensor
methods that would sync.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lorastream.core.generation import PromptInput
from lorastream.worker.engine.engine import Engine
from lorastream.worker.engine.sampling import SamplingParams
from lorastream.worker.service.operations import WorkerOperations
from tests.worker.conftest import ADAPTERS, NEW_TOKENS, PROMPTS, EngineFactory


class SyncGuard:
    """Wraps an engine's step and sampler: sync debug mode "error" from the start of each step
    until its sampler returned; what raised inside is kept (the engine would turn it into
    request failures)."""

    def __init__(self, engine: Engine) -> None:
        self.errors: list[BaseException] = []
        self.steps = 0
        self._lock = threading.Lock()
        step, sample = engine._step, engine.sampler.step

        def guarded_step(plan: object) -> None:
            torch.cuda.set_sync_debug_mode("error")
            try:
                step(plan)
                self.steps += 1
            except BaseException as err:
                with self._lock:
                    self.errors.append(err)
                raise
            finally:
                torch.cuda.set_sync_debug_mode("default")

        def guarded_sample(*args: object, **kwargs: object) -> object:
            sampled = sample(*args, **kwargs)  # under "error", like the rest of the step
            torch.cuda.set_sync_debug_mode("default")  # the step's one read: tokens.tolist()
            return sampled

        engine._step = guarded_step  # type: ignore[method-assign]  # a guard wrapped around the method
        engine.sampler.step = guarded_sample  # type: ignore[method-assign]  # a guard wrapped around the method


@pytest.fixture
def sync_debug_off_after() -> Iterator[None]:
    yield
    torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mixed_adapter_steps_on_cuda_never_sync_the_host(
    engine_factory: EngineFactory, tiny_adapters: dict[str, Path],
    reference: dict[tuple[str, int], list[int]], sync_debug_off_after: None, backend: str,
) -> None:
    engine = engine_factory(start=False, device="cuda", dtype="float32", lora_backend=backend)
    ops = WorkerOperations(engine)
    for name, path in tiny_adapters.items():  # loads: before the guard, not on the step path
        ops.load_adapter(name, str(path))
    guard = SyncGuard(engine)
    streams = {
        (name, i): engine.submit(name, PromptInput(token_ids=tuple(prompt)),
                                 SamplingParams(max_tokens=NEW_TOKENS))
        for name in ["tiny", *ADAPTERS] for i, prompt in enumerate(PROMPTS)
    }
    engine.start()
    try:
        results = {key: [t for e in stream for t in e.token_ids] for key, stream in streams.items()}
    finally:  # a failed step fails its requests: name the sync, not the request error
        assert not guard.errors, f"a step synchronized with the host: {guard.errors[0]!r}"
    assert guard.steps >= NEW_TOKENS - 1  # the prefill and the decode steps ran guarded
    for (name, i), tokens in results.items():
        assert tokens == reference[("base" if name == "tiny" else name, i)], f"{name} prompt {i}"


def test_the_guard_catches_a_sync(sync_debug_off_after: None) -> None:
    torch.cuda.set_sync_debug_mode("error")
    with pytest.raises(RuntimeError, match="called a synchronizing CUDA operation"):
        torch.ones(4, device="cuda").sum().item()
