"""The engine against HF transformers + PEFT: one mixed batch, every adapter, same greedy tokens;
weighted mixes of adapters beside single adapters and the base model against PEFT's
``add_weighted_adapter(combination_type="cat")``."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from lorastream.core.adapter_mix import mix_model
from lorastream.core.errors import AdapterNotFound, InvalidArgument, LorastreamError
from lorastream.core.generation import FinishReason, PromptInput
from lorastream.kernels.cpu import ops as cpu_ops
from lorastream.worker.engine.sampling import SamplingParams
from lorastream.worker.engine.sequence import RequestStream
from lorastream.worker.lora import backend as lora_backend
from lorastream.worker.lora.backend import LoraStep, TorchLoraBackend
from lorastream.worker.service.operations import WorkerOperations
from tests.support.batched_forward import model_and_slots, prefill_last_logits
from tests.support.families import peft_mix_model
from tests.support.models import (
    ALORA_INVOCATION,
    ATTENTION,
    make_peft_adapter,
    save_adapter_tokenizer,
)
from tests.worker.conftest import (
    ADAPTERS,
    NEW_TOKENS,
    PROMPTS,
    EngineFactory,
    peft_model,
    reference_greedy,
)

# Two mixes, one sharing attn-r4 with a single-adapter row, and a reweighting of the first (its
# own prefix-cache key); none starts with the rsLoRA adapter (peft_mix_model).
MIXES: dict[str, tuple[tuple[str, float], ...]] = {
    "mix-a": (("attn-r4", 0.7), ("mlp-r8", 0.6)),
    "mix-b": (("mlp-r8", 0.5), ("all-r16-rslora", 1.3)),
    "mix-a-reweighted": (("attn-r4", 1.2), ("mlp-r8", -0.4)),
}
SINGLES = ("attn-r4", "all-r64")


def _collect(stream) -> tuple[list[int], str, FinishReason | None]:
    tokens, text, reason = [], "", None
    for event in stream:
        tokens.extend(event.token_ids)
        text += event.text
        reason = event.finish_reason
    return tokens, text, reason


@pytest.mark.parametrize("kernels", ["native", "torch"])  # --cpu-kernels
def test_one_mixed_batch_of_every_adapter_and_the_base_gives_peft_greedy_tokens(
    engine_factory: EngineFactory,
    tiny_adapters: dict[str, Path],
    reference: dict[tuple[str, int], list[int]],
    kernels: str,
) -> None:
    # requests queue up and land in the same first step
    engine = engine_factory(start=False, cpu_kernels=kernels)
    assert engine.model.native_attention is (kernels == "native")
    assert engine.backend.native is (kernels == "native")  # type: ignore[attr-defined]  # native: on the torch backend only
    ops = WorkerOperations(engine)
    for name, path in tiny_adapters.items():
        ops.load_adapter(name, str(path))
    streams = {}
    for name in ["tiny", *ADAPTERS]:
        for i, prompt in enumerate(PROMPTS):
            streams[(name, i)] = engine.submit(
                name, PromptInput(token_ids=tuple(prompt)), SamplingParams(max_tokens=NEW_TOKENS)
            )
    engine.start()
    for (name, i), stream in streams.items():
        tokens, _, reason = _collect(stream)
        expected = reference[("base" if name == "tiny" else name, i)]
        assert tokens == expected, f"{name} prompt {i}"
        assert reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert engine.stats.peak_running == len(streams)  # all of them in one running batch
    for name in ADAPTERS:  # the adapters do change the output: the comparison proves something
        assert any(reference[(name, i)] != reference[("base", i)] for i in range(len(PROMPTS)))


@pytest.mark.parametrize("chunk", [None, 3], ids=["whole-prompt", "chunked-prefill"])
def test_mixed_batch_logits_agree_with_peft_within_fp32_tolerance(
    tiny_model: Path,
    tiny_adapters: dict[str, Path],
    chunk: int | None,
) -> None:
    model, slots, slot_of = model_and_slots(tiny_model, tiny_adapters, rank=64, first_slot=1)
    names = ["base", *ADAPTERS]
    out = prefill_last_logits(model, slots, slot_of, names, PROMPTS[1], chunk)  # [names, V]
    logits = dict(zip(names, out, strict=True))
    prompt = PROMPTS[1]
    for name in names:
        ref_model = peft_model(tiny_model, None if name == "base" else tiny_adapters[name])
        with torch.no_grad():
            expected = ref_model(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(logits[name], expected, rtol=1e-4, atol=1e-4)
        if name != "base":
            assert not torch.allclose(logits[name], logits["base"], atol=1e-3), name


@pytest.fixture(scope="module")
def mix_reference(
    tiny_model: Path, tiny_adapters: dict[str, Path]
) -> dict[tuple[str, int], list[int]]:
    """(mix name, prompt index) -> PEFT's cat-mix greedy tokens."""
    refs = {}
    for name, mix in MIXES.items():
        model = peft_mix_model(tiny_model, tiny_adapters, mix)
        for i, prompt in enumerate(PROMPTS):
            refs[(name, i)] = reference_greedy(model, prompt, NEW_TOKENS)
    return refs


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
@pytest.mark.parametrize("kernels", ["native", "torch"])  # --cpu-kernels
def test_weighted_mixes_beside_single_adapters_and_the_base_give_peft_cat_greedy_tokens(
    engine_factory: EngineFactory,
    tiny_adapters: dict[str, Path],
    reference: dict[tuple[str, int], list[int]],
    mix_reference: dict[tuple[str, int], list[int]],
    kernels: str,
    prefix_caching: bool,
) -> None:
    """Two rounds of one batch each: the base model, two single adapters and the mixes (by the
    ``mix`` argument and by the ``mix:`` model spelling). Round 2 repeats the prompts of round
    1's mixes but one: with the cache on a mix reuses its own blocks, never another weighting's."""
    engine = engine_factory(start=False, cpu_kernels=kernels, prefix_caching=prefix_caching)
    ops = WorkerOperations(engine)
    for name, path in tiny_adapters.items():
        ops.load_adapter(name, str(path))

    def submit(mixes: list[str]) -> dict[tuple[str, int], RequestStream]:
        streams = {}
        for i, prompt in enumerate(PROMPTS):
            ids = PromptInput(token_ids=tuple(prompt))
            params = SamplingParams(max_tokens=NEW_TOKENS)
            for name in ["tiny", *SINGLES]:
                streams[(name, i)] = engine.submit(name, ids, params)
            for k, name in enumerate(mixes):  # half by the field, half by the model spelling
                streams[(name, i)] = (engine.submit("", ids, params, mix=MIXES[name]) if k % 2
                                      else engine.submit(mix_model(MIXES[name]), ids, params))
        return streams

    def check(streams: dict[tuple[str, int], RequestStream]) -> dict[tuple[str, int], int]:
        cached = {}
        for (name, i), stream in streams.items():
            events = list(stream)
            tokens = [t for e in events for t in e.token_ids]
            expected = (mix_reference[(name, i)] if name in MIXES
                        else reference[("base" if name == "tiny" else name, i)])
            assert tokens == expected, f"{name} prompt {i}"
            cached[(name, i)] = events[-1].cached_tokens
        return cached

    first = submit(["mix-a", "mix-b"])
    engine.start()
    check(first)
    cached = check(submit(["mix-a", "mix-b", "mix-a-reweighted"]))
    long_prompt = 1  # 19 tokens: one full block to reuse
    assert cached[("mix-a", long_prompt)] == (16 if prefix_caching else 0)
    assert cached[("mix-a-reweighted", long_prompt)] == 0  # other weights: other K/V
    assert engine.slots.num_slots >= len(ADAPTERS)
    for name, mix in MIXES.items():  # each mix differs from each of its components alone
        for component, _ in mix:
            assert any(mix_reference[(name, i)] != reference[(component, i)]
                       for i in range(len(PROMPTS))), (name, component)


@pytest.mark.parametrize(("padding_limit", "native"), [(0.0, False), (1e9, False), (1e9, True)],
                         ids=["grouped", "slot-major", "slot-major-native"])
@pytest.mark.parametrize("dropped", [None, "weight", "component"])
def test_mix_rows_logits_agree_with_peft_cat_and_a_dropped_weight_fails(
    tiny_model: Path,
    tiny_adapters: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    padding_limit: float,
    native: bool,
    dropped: str | None,
) -> None:
    """One prefill batch of the base, a single adapter and two mixes in both layouts (the
    slot-major one also with the C++ ``lora_rows`` over its entries); with a mix weight forced
    to 1 or a component left out of the step (the faults the comparison must catch), the
    logits no longer match."""
    monkeypatch.setattr(lora_backend, "PADDING_LIMIT", padding_limit)
    assert not native or cpu_ops.load() is None
    model, slots, slot_of = model_and_slots(tiny_model, tiny_adapters, rank=64, first_slot=1)
    rows: dict[str, lora_backend.RowLora] = {"base": -1, "attn-r4": slot_of["attn-r4"]}
    for name in ("mix-a", "mix-b"):
        mix = tuple((slot_of[a], w) for a, w in MIXES[name])
        if name == "mix-a" and dropped == "weight":
            mix = ((mix[0][0], 1.0), *mix[1:])
        if name == "mix-a" and dropped == "component":
            mix = mix[:1]
        rows[name] = mix
    prompt = PROMPTS[1]
    steps: list[LoraStep] = []
    out = prefill_last_logits(model, slots, rows, list(rows), prompt,
                              backend=TorchLoraBackend(torch.float32, model.device, native),
                              on_step=steps.append)  # [rows, V]
    assert len(steps) == 1
    meta = steps[0]._meta  # the layout the parameter asks for
    assert meta.slot_major is (padding_limit > 1) and meta.entry_rows is not None
    logits = dict(zip(rows, out, strict=True))
    for name in rows:
        if name in MIXES:
            ref_model = peft_mix_model(tiny_model, tiny_adapters, MIXES[name])
        else:
            ref_model = peft_model(tiny_model, None if name == "base" else tiny_adapters[name])
        with torch.no_grad():
            expected = ref_model(torch.tensor([prompt])).logits[0, -1]
        if name == "mix-a" and dropped is not None:
            assert not torch.allclose(logits[name], expected, rtol=1e-4, atol=1e-4), dropped
        else:
            torch.testing.assert_close(logits[name], expected, rtol=1e-4, atol=1e-4)


def test_mixes_waiting_for_each_others_slots_run_in_queue_order(
    engine_factory: EngineFactory,
    tiny_adapters: dict[str, Path],
    reference: dict[tuple[str, int], list[int]],
    mix_reference: dict[tuple[str, int], list[int]],
) -> None:
    """2 slots holding attn-r4 and all-r16-rslora (mlp-r8, loaded first, was evicted for the
    last); mix-a needs attn-r4 + mlp-r8, mix-b mlp-r8 + all-r16-rslora. Each holds a reference on
    the adapter in the slot the other needs: mix-a, first in the queue, evicts mix-b's for
    mlp-r8, then mix-b runs (without that, neither would ever start)."""
    engine = engine_factory(start=False, max_loras=2)
    ops = WorkerOperations(engine)
    for name in ("mlp-r8", "attn-r4", "all-r16-rslora"):
        ops.load_adapter(name, str(tiny_adapters[name]))
    resident = {s.adapter_id for s in engine.slots.table}
    assert resident == {engine.adapters.resolve(n) for n in ("attn-r4", "all-r16-rslora")}
    prompt = PromptInput(token_ids=tuple(PROMPTS[0]))
    params = SamplingParams(max_tokens=NEW_TOKENS)
    streams = {name: engine.submit(name, prompt, params) for name in ("attn-r4", "all-r16-rslora")}
    streams |= {name: engine.submit("", prompt, params, mix=MIXES[name])
                for name in ("mix-a", "mix-b")}
    engine.start()
    pool = ThreadPoolExecutor(len(streams))
    try:
        done = {name: pool.submit(list, stream) for name, stream in streams.items()}
        for name, future in done.items():
            tokens = [t for e in future.result(timeout=120) for t in e.token_ids]
            expected = mix_reference[(name, 0)] if name in MIXES else reference[(name, 0)]
            assert tokens == expected, name
    finally:  # a stuck request ends the test instead of hanging it
        for stream in streams.values():
            stream.cancel()
        pool.shutdown()


@pytest.mark.parametrize(
    ("mix", "error", "says"),
    [
        ((("attn-r4", 1.0), ("ghost", 1.0)), AdapterNotFound, "ghost"),
        ((("attn-r4", 1.0), ("mlp-r8", 1.0), ("all-r64", 1.0)), InvalidArgument, "at most 2"),
        ((("attn-r4", float("nan")),), InvalidArgument, "finite"),
        ((("attn-r4", 0.5), ("attn-r4", 0.5)), InvalidArgument, "more than once"),
        ((("attn-r4", 1.0), ("dora", 1.0)), InvalidArgument, "'dora' cannot be part"),
        ((("alora", 1.0),), InvalidArgument, "activated LoRA"),
        ((("attn-r4", 1.0), ("own-tokenizer", 1.0)), InvalidArgument, "its own tokenizer"),
        ((), InvalidArgument, "<adapter>=<weight>"),  # model "mix:" with nothing after it
    ],
    ids=["unknown", "over-the-limit", "nan", "duplicate", "dora", "activated", "tokenizer",
         "empty"],
)
def test_the_worker_refuses_a_bad_mix_itself_holding_nothing(
    engine_factory: EngineFactory,
    tiny_model: Path,
    tiny_adapters: dict[str, Path],
    tmp_path: Path,
    mix: tuple[tuple[str, float], ...],
    error: type[LorastreamError],
    says: str,
) -> None:
    """What a direct gRPC caller could send: the worker checks every rule the gateway does."""
    engine = engine_factory(max_mix_adapters=2)
    ops = WorkerOperations(engine)
    for name in ("attn-r4", "mlp-r8", "all-r64"):
        ops.load_adapter(name, str(tiny_adapters[name]))
    ops.load_adapter("dora", str(make_peft_adapter(tiny_model, tmp_path / "dora", rank=4,
                                                   targets=ATTENTION, use_dora=True)))
    ops.load_adapter("alora", str(make_peft_adapter(
        tiny_model, tmp_path / "alora", rank=4, targets=ATTENTION,
        alora_invocation_tokens=list(ALORA_INVOCATION))))
    own = shutil.copytree(tiny_adapters["mlp-r8"], tmp_path / "own-tokenizer")
    save_adapter_tokenizer(tiny_model, own, {})  # a plain LoRA shipped with a tokenizer
    ops.load_adapter("own-tokenizer", str(own))
    prompt, params = PromptInput(token_ids=tuple(PROMPTS[0])), SamplingParams(max_tokens=2)
    with pytest.raises(error) as caught:
        if mix:
            engine.submit("", prompt, params, mix=mix)
        else:
            engine.submit("mix:", prompt, params)
    assert says in str(caught.value)
    assert engine.adapters.usage().references == 0 and engine.waiting == 0
