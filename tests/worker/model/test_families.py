"""Every model family against HF transformers + PEFT, through the worker's gRPC ``Generate``.

Per family: a tiny random checkpoint made by transformers from a config that switches on what
the family changes (sliding windows shorter than the prompts, soft-capping, biases, q/k norms,
head_dim != hidden / heads, fused projections), three PEFT adapters of different ranks and
targets (one rsLoRA, B not zero). The base model and every adapter run in ONE batch and must give
the reference's greedy tokens. Then what must be refused is refused: adapters of another family
or shape, checkpoints whose weights disagree with their config.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lorastream.core import errors
from lorastream.core.generation import PromptInput, SamplingParams
from lorastream.core.store_client import StoreClient
from lorastream.core.worker_client import WorkerClient
from lorastream.store.config import StoreSettings
from lorastream.store.server import create_server as create_store
from lorastream.worker.engine.engine import Engine
from lorastream.worker.model.config import ModelConfig
from lorastream.worker.service.bootstrap import build_engine
from lorastream.worker.service.config import WorkerSettings
from lorastream.worker.service.operations import WorkerOperations
from lorastream.worker.service.server import create_server as create_worker
from tests.support.batched_forward import model_and_slots, prefill_last_logits
from tests.support.families import (
    BASE,
    NEW_TOKENS,
    PROMPTS,
    FamilyCase,
    make_family_case,
    reference_model,
)
from tests.support.models import (
    FAMILY_CONFIGS,
    FAMILY_TARGETS,
    WINDOW,
    make_family_adapter,
    make_tiny_family,
)

FAMILIES = list(FAMILY_CONFIGS)


@pytest.fixture(scope="module", params=FAMILIES)
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> FamilyCase:
    return make_family_case(request.param, tmp_path_factory.mktemp(request.param))


@dataclass
class Worker:
    target: str
    store: str
    engine: Engine


@pytest.fixture
def worker(case: FamilyCase, tmp_path: Path) -> Iterator[Worker]:
    """A store holding the case's adapters and a worker on the case's checkpoint (its engine not
    started yet, so that requests queue up for one batch)."""
    store_server, store_port, _ = create_store(StoreSettings(port=0, cache_dir=tmp_path / "store"))
    store_server.start()
    store = f"127.0.0.1:{store_port}"
    with StoreClient(store) as client:
        for name, path in case.adapters.items():
            for _ in client.preload(str(path), name):
                pass
    settings = WorkerSettings(
        model=str(case.checkpoint), served_model_name=BASE, port=0, store=store, max_loras=4,
        max_lora_rank=16, kv_cache_bytes=4 << 20, model_cache_dir=tmp_path / "models",
    )
    engine = build_engine(settings, checkpoint=case.checkpoint)
    server, port, _ = create_worker(settings, engine, start_engine=False)
    server.start()
    yield Worker(f"127.0.0.1:{port}", store, engine)
    server.stop(None).wait()
    engine.stop()
    store_server.stop(None).wait()


def test_one_mixed_batch_over_grpc_gives_peft_greedy_tokens(
    case: FamilyCase, worker: Worker
) -> None:
    assert min(len(p) for p in PROMPTS) > WINDOW  # the window is in play
    engine = worker.engine
    with WorkerClient(worker.target) as client:
        for name in case.adapters:
            assert client.load_adapter(name).residency == "device"
    results: dict[tuple[str, int], list[int]] = {}
    failures: list[BaseException] = []

    def generate(name: str, i: int) -> None:
        try:
            with WorkerClient(worker.target) as client:
                events = client.generate(
                    name, PromptInput(token_ids=tuple(PROMPTS[i])),
                    SamplingParams(max_tokens=NEW_TOKENS),
                )
                results[(name, i)] = [t for event in events for t in event.token_ids]
        except BaseException as err:
            failures.append(err)

    keys = [(name, i) for name in [BASE, *case.adapters] for i in range(len(PROMPTS))]
    threads = [threading.Thread(target=generate, args=key) for key in keys]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while engine.waiting < len(keys) and time.monotonic() < deadline and not failures:
        time.sleep(0.01)
    engine.start()  # every request is queued: they run as one batch
    for thread in threads:
        thread.join(60)
    assert not failures, failures
    # one batch: all ran together (but for any that stopped at eos on its first token)
    done_at_once = sum(len(case.reference[key]) == 1 for key in keys)
    assert engine.stats.peak_running == len(keys) - done_at_once
    for key in keys:
        assert results[key] == case.reference[key], f"{case.family} {key}"
    for name in case.adapters:  # each adapter changes the output: the comparison proves something
        assert any(case.reference[(name, i)] != case.reference[(BASE, i)] for i in range(3))


@pytest.mark.parametrize("chunk", [None, 5], ids=["whole-prompt", "chunked-prefill"])
def test_mixed_batch_logits_agree_with_peft(case: FamilyCase, chunk: int | None) -> None:
    """Logits, not only their argmax (final soft-capping keeps the argmax), of the base model and
    every adapter in one forward; chunked, a chunk attends over a cached past beyond the window."""
    model, slots, slot_of = model_and_slots(case.checkpoint, case.adapters)
    names = [BASE, *case.adapters]
    logits = prefill_last_logits(model, slots, slot_of, names, PROMPTS[1], chunk)  # [names, V]
    for row, name in enumerate(names):
        reference = reference_model(case.checkpoint, case.adapters.get(name))
        with torch.no_grad():
            expected = reference(torch.tensor([PROMPTS[1]])).logits[0, -1]  # [V]
        torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=1e-4)


# -- adapters that do not fit the family -------------------------------------------------------
@pytest.fixture(scope="module")
def foreign(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Adapters made for other bases: a Llama's (q_proj ...), a Phi-3's (qkv_proj ...), and one
    for a Qwen3 whose head_dim differs from the test Qwen3's (same hidden size)."""
    root = tmp_path_factory.mktemp("foreign")
    bases = {
        "llama": make_tiny_family("llama", root / "llama"),
        "phi3": make_tiny_family("phi3", root / "phi3"),
        "qwen3": make_tiny_family("qwen3", root / "qwen3", head_dim=16),
    }
    return {
        family: make_family_adapter(base, root / f"{family}-adapter", rank=4, targets="all-linear")
        for family, base in bases.items()
    }


@pytest.mark.parametrize(
    ("base", "adapter", "message"),
    [
        ("phi3", "llama",
         r"targets (q|k|v|gate|up)_proj, which .*model_type 'phi3'.* its adaptable modules are "
         r"qkv_proj, o_proj, gate_up_proj, down_proj"),
        ("gemma2", "phi3",
         r"targets (qkv|gate_up)_proj, which .*model_type 'gemma2'.* its adaptable modules are "
         r"q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"),
        ("qwen3", "qwen3", r"different base model: layer \d+ [a-z_]+ lora_[AB] is \[\d+, \d+\], "
         r"but .*model_type 'qwen3'.* needs"),
    ],
)
def test_an_adapter_of_another_family_or_shape_is_refused_before_a_slot(
    foreign: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, tmp_path: Path,
    base: str, adapter: str, message: str,
) -> None:
    checkpoint = make_tiny_family(base, tmp_path_factory.mktemp(base) / "model")
    engine = build_engine(WorkerSettings(
        model=str(checkpoint), served_model_name=BASE, max_loras=2, max_lora_rank=8,
        kv_cache_bytes=1 << 20, model_cache_dir=tmp_path / "models",
    ), checkpoint=checkpoint)
    try:
        with pytest.raises(errors.InvalidAdapter, match=message):
            WorkerOperations(engine).load_adapter("bad", str(foreign[adapter]))
        assert engine.adapters.usage().slots_used == 0
    finally:
        engine.stop()


def test_over_grpc_an_adapter_of_another_family_is_invalid_argument_naming_the_family(
    case: FamilyCase, worker: Worker, foreign: dict[str, Path]
) -> None:
    other = "llama" if case.family == "phi3" else "phi3"  # fused vs separate projections
    with StoreClient(worker.store) as client:
        for _ in client.preload(str(foreign[other]), "foreign"):
            pass
    worker.engine.start()
    prompt, params = PromptInput(token_ids=tuple(PROMPTS[0])), SamplingParams(max_tokens=2)
    with WorkerClient(worker.target) as client:
        with pytest.raises(errors.InvalidArgument, match=f"model_type '{case.family}'"):
            list(client.generate("foreign", prompt, params))
        assert [t for e in client.generate(BASE, prompt, params) for t in e.token_ids]
    assert worker.engine.adapters.usage().slots_used == 0


# -- checkpoints that disagree with their config -----------------------------------------------
def _edit_weights(checkpoint: Path, edit: dict[str, torch.Tensor | None]) -> None:
    state = load_file(str(checkpoint / "model.safetensors"))
    for key, value in edit.items():
        if value is None:
            del state[key]
        else:
            state[key] = value
    save_file(state, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})


def _edit_config(checkpoint: Path, changes: dict[str, object]) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, **changes}))


BROKEN = {
    "missing-q-norm": (
        "qwen3", lambda c: _edit_weights(c, {"model.layers.1.self_attn.q_norm.weight": None}),
        r"weight model.layers.1.self_attn.q_norm.weight is missing .*model_type qwen3",
    ),
    "unexpected-bias": (  # a Qwen2 checkpoint (q/k/v biases) that says it is a Llama
        "qwen2", lambda c: _edit_config(c, {"model_type": "llama", "architectures": None}),
        r"tensor model.layers.0.self_attn.k_proj.bias \(and 5 more\) is in the checkpoint but "
        r"config.json \(model_type llama\) has no such weight",
    ),
    "wrong-shape": (
        "gemma2", lambda c: _edit_config(c, {"head_dim": 16}),
        r"model.layers.0.self_attn.q_proj.weight is \[128, 64\], config.json .* implies \[64, 64\]",
    ),
    "unsupported-model-type": (
        "llama", lambda c: _edit_config(c, {"model_type": "falcon", "architectures": None}),
        r"model_type 'falcon' .*not supported; the worker serves these families: llama, mistral, "
        r"qwen2, qwen3, gemma2, gemma3_text, phi3, qwen3_moe, mixtral, qwen2_moe",
    ),
    "unsupported-activation": (
        "mistral", lambda c: _edit_config(c, {"hidden_act": "relu2"}),
        r"hidden_act 'relu2' is not supported for mistral",
    ),
}


@pytest.mark.parametrize(("family", "edit", "message"), BROKEN.values(), ids=BROKEN.keys())
def test_a_checkpoint_that_disagrees_with_its_config_is_refused_at_start(
    tmp_path: Path, family: str, edit, message: str
) -> None:
    checkpoint = make_tiny_family(family, tmp_path / "model")
    edit(checkpoint)
    settings = WorkerSettings(
        model=str(checkpoint), served_model_name=BASE, kv_cache_bytes=1 << 20,
        model_cache_dir=tmp_path / "models",
    )
    with pytest.raises(errors.InvalidArgument, match=message):
        build_engine(settings)  # resolves, reads and checks everything before building anything


@pytest.mark.parametrize("family", FAMILIES)
def test_the_family_states_its_targets_and_windows(tmp_path: Path, family: str) -> None:
    config = ModelConfig.from_dir(make_tiny_family(family, tmp_path / "model"))
    attention, mlp = FAMILY_TARGETS[family]
    assert config.family == family
    assert set(config.module_shapes()) == {*attention, *mlp}
    windows = {"llama": (), "qwen3": (), "mistral": (WINDOW, WINDOW), "phi3": (WINDOW, WINDOW),
               "qwen2": (None, WINDOW), "gemma2": (WINDOW, None), "gemma3_text": (WINDOW, None)}
    assert config.layer_windows == windows[family]
