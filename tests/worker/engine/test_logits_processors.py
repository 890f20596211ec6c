"""Penalties, logit bias, min_tokens and logprobs: against transformers' own logits processors on
the same logits, a plain reference for OpenAI's penalties, a float64 recomputation for logprobs,
and, end to end, HF + PEFT ``generate`` with the same processors in one mixed-adapter batch."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from lorastream.core.generation import PromptInput, SamplingParams
from lorastream.worker.engine.logits_processors import TokenHistory, process_logits_
from lorastream.worker.engine.sampling import Sampler, SamplingRow, make_generator
from lorastream.worker.service.operations import WorkerOperations
from tests.support.sync_free import TorchCallLog
from tests.worker.conftest import ADAPTERS, PROMPTS, EngineFactory, peft_model

VOCAB = 300
EOS = 2


def _logits(batch: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, VOCAB, generator=generator) * 4  # [B, V]


def _ids(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 40, (length,), generator=generator).tolist()  # repeats on purpose


def _row(params: SamplingParams, prompt: list[int], output: list[int],
         eos: frozenset[int] = frozenset({EOS})) -> SamplingRow:
    """A sampling row as the engine builds it (step_sampling.sampling_row)."""
    history = None
    if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1:
        history = TokenHistory(prompt, output, VOCAB, torch.device("cpu"))
    stop = eos | frozenset(params.stop_token_ids) if len(output) < params.min_tokens else None
    return SamplingRow(params, make_generator(params.seed), history, len(output),
                       stop or frozenset())


class OpenAIPenalties(LogitsProcessor):
    """The plain reference: OpenAI's documented formula, token by token, over generated ids."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        for b in range(scores.shape[0]):
            generated = input_ids[b, self.prompt_len:].tolist()
            for token in set(generated):
                scores[b, token] -= self.frequency * generated.count(token) + self.presence
        return scores


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
@pytest.mark.parametrize("generated", [0, 1, 9])
def test_repetition_penalty_equals_hf_over_prompt_and_generated(
    penalty: float, generated: int
) -> None:
    logits = _logits(4, seed=generated)
    prompts = [_ids(7, seed=s) for s in range(4)]
    outputs = [_ids(generated, seed=10 + s) for s in range(4)]
    params = SamplingParams(repetition_penalty=penalty)
    rows = [_row(params, p, o) for p, o in zip(prompts, outputs, strict=True)]
    ours = process_logits_(logits.clone(), rows)
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    for b in range(4):
        expected = hf(torch.tensor([prompts[b] + outputs[b]]), logits[b : b + 1].clone())
        torch.testing.assert_close(ours[b], expected[0], rtol=0, atol=0)
    assert not torch.equal(ours, logits)


@pytest.mark.parametrize(
    "bias", [{5: 100.0}, {5: -100.0, 7: 3.5}, {0: 0.25, 299: -1.0, 150: 42.0}]
)
def test_logit_bias_equals_hf_sequence_bias(bias: dict[int, float]) -> None:
    logits = _logits(3, seed=1)
    params = SamplingParams(logit_bias=tuple(bias.items()))
    ours = process_logits_(logits.clone(), [_row(params, [1], [])] * 3)
    hf = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])
    expected = hf(torch.tensor([[1]] * 3), logits.clone())
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


@pytest.mark.parametrize(("min_tokens", "generated"), [(4, 0), (4, 3), (4, 4), (4, 9), (0, 0)])
@pytest.mark.parametrize("stop_token_ids", [(), (9, 17)])
def test_min_tokens_masks_eos_and_stop_ids_like_hf_min_new_tokens(
    min_tokens: int, generated: int, stop_token_ids: tuple[int, ...]
) -> None:
    logits = _logits(2, seed=generated)
    prompt = _ids(5, seed=3)
    params = SamplingParams(min_tokens=min_tokens, stop_token_ids=stop_token_ids)
    output = _ids(generated, seed=4)
    ours = process_logits_(logits.clone(), [_row(params, prompt, output)] * 2)
    hf = MinNewTokensLengthLogitsProcessor(len(prompt), min_tokens, [EOS, *stop_token_ids])
    expected = hf(torch.tensor([prompt + output] * 2), logits.clone())
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    assert torch.isinf(ours[:, EOS]).all() == (generated < min_tokens)


@pytest.mark.parametrize(("presence", "frequency"), [(0.0, 0.7), (1.5, 0.0), (-2.0, 2.0)])
def test_presence_and_frequency_penalties_equal_openais_formula(
    presence: float, frequency: float
) -> None:
    logits = _logits(3, seed=2)
    prompt = _ids(6, seed=5)
    outputs = [_ids(n, seed=6 + n) for n in (0, 5, 12)]
    params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency)
    ours = process_logits_(logits.clone(), [_row(params, prompt, o) for o in outputs])
    reference = OpenAIPenalties(len(prompt), presence, frequency)
    for b, output in enumerate(outputs):
        expected = reference(torch.tensor([prompt + output]), logits[b : b + 1])
        torch.testing.assert_close(ours[b], expected[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours[0], logits[0], rtol=0, atol=0)  # nothing generated yet


def test_every_processor_together_equals_hf_chain_and_leaves_other_rows_alone() -> None:
    logits = _logits(4, seed=7)
    prompt, output = _ids(8, seed=8), _ids(3, seed=9)
    params = SamplingParams(
        repetition_penalty=1.4, logit_bias=((EOS, 5.0), (11, -7.0)), min_tokens=5
    )
    plain = SamplingParams(temperature=0.8)
    rows = [_row(plain, prompt, output), _row(params, prompt, output), _row(plain, [3], []),
            _row(params, prompt, output)]
    ours = process_logits_(logits.clone(), rows)
    chain = LogitsProcessorList([
        RepetitionPenaltyLogitsProcessor(1.4),
        MinNewTokensLengthLogitsProcessor(len(prompt), 5, EOS),
        SequenceBiasLogitsProcessor([[[EOS], 5.0], [[11], -7.0]]),
    ])
    for b in (1, 3):
        expected = chain(torch.tensor([prompt + output]), logits[b : b + 1].clone())[0]
        torch.testing.assert_close(ours[b], expected, rtol=0, atol=0)
    for b in (0, 2):
        assert torch.equal(ours[b], logits[b])


@pytest.mark.parametrize("k", [0, 1, 5, 20])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_are_log_softmax_of_the_processed_logits_in_float64(
    k: int, temperature: float
) -> None:
    logits = _logits(5, seed=k)
    params = SamplingParams(temperature=temperature, logprobs=k, repetition_penalty=1.2,
                            logit_bias=((4, 2.0),), seed=3)
    prompt, output = _ids(6, seed=1), _ids(2, seed=2)
    rows = [_row(params, prompt, output), _row(SamplingParams(), [1], []),
            _row(params, prompt, output), _row(SamplingParams(logprobs=k), [1], []),
            _row(SamplingParams(temperature=1.0, seed=1), [1], [])]
    processed = process_logits_(logits.clone(), rows).double()
    out = Sampler().step(logits.clone(), rows)
    assert out.logprobs is not None and out.logprobs.rows == [0, 2, 3]
    values = out.logprobs.to_host()
    tokens = out.tokens.tolist()
    for row, (chosen, top) in values.items():
        exact = torch.log_softmax(processed[row], -1)  # [V] float64
        assert chosen == pytest.approx(exact[tokens[row]].item(), abs=1e-5)
        assert [t for t, _ in top] == exact.topk(k).indices.tolist()
        assert [v for _, v in top] == pytest.approx(exact.topk(k).values.tolist(), abs=1e-5)
        if rows[row].params.greedy and k:
            assert chosen == max(v for _, v in top)  # the greedy token is the most likely
    assert set(values) == {0, 2, 3}


def test_sampling_counts_each_token_into_its_history() -> None:
    params = SamplingParams(frequency_penalty=0.5)
    rows = [_row(params, [1, 2], [7, 7]), _row(SamplingParams(), [1], [])]
    sampler = Sampler()
    tokens = sampler.step(_logits(2), rows).tokens
    counts = rows[0].history.output_counts  # type: ignore[union-attr]  # history is set on a running row
    assert counts[7] == 2 + (tokens[0] == 7)
    assert counts.sum() == 3 and counts[tokens[0]] >= 1


def test_processing_and_logprobs_read_nothing_back_from_the_device() -> None:
    params = SamplingParams(presence_penalty=0.5, repetition_penalty=1.1, logit_bias=((3, 1.0),),
                            min_tokens=4, logprobs=5)
    rows = [_row(params, [1, 2, 3], [4]), _row(SamplingParams(), [5], [])] * 4
    with TorchCallLog() as log:
        Sampler().step(_logits(8), rows)
    reads = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "nonzero"}
    assert not reads & set(log.calls), sorted(reads & set(log.calls))


# -- end to end: the engine against HF + PEFT generate with the same processors ------------------
def _hf_tokens(model: torch.nn.Module, prompt: list[int], new: int,
               processors: list[LogitsProcessor]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            logits_processor=LogitsProcessorList(processors), eos_token_id=EOS,
        )
    return out[0, len(prompt):].tolist()


def test_mixed_adapter_batch_with_different_params_matches_hf_peft_row_by_row(
    engine_factory: EngineFactory,
    tiny_model: Path,
    tiny_adapters: dict[str, Path],
    reference: dict[tuple[str, int], list[int]],
) -> None:
    new = 12
    # (model, prompt index, params, HF processors for the same greedy decode)
    cases: list[tuple[str, int, SamplingParams, list[LogitsProcessor]]] = [
        ("attn-r4", 0, SamplingParams(repetition_penalty=1.6),
         [RepetitionPenaltyLogitsProcessor(1.6)]),
        ("mlp-r8", 1, SamplingParams(presence_penalty=-2.0, frequency_penalty=0.5),
         [OpenAIPenalties(len(PROMPTS[1]), -2.0, 0.5)]),
        ("all-r64", 2, SamplingParams(logit_bias=((EOS, 30.0), (70, 4.0)), min_tokens=5),
         [MinNewTokensLengthLogitsProcessor(len(PROMPTS[2]), 5, EOS),
          SequenceBiasLogitsProcessor([[[EOS], 30.0], [[70], 4.0]])]),
        ("tiny", 0, SamplingParams(repetition_penalty=0.7, logit_bias=((9, -3.0),)),
         [RepetitionPenaltyLogitsProcessor(0.7), SequenceBiasLogitsProcessor([[[9], -3.0]])]),
    ]
    engine = engine_factory(start=False)  # everything lands in the same first step
    ops = WorkerOperations(engine)
    for name, path in tiny_adapters.items():
        ops.load_adapter(name, str(path))
    streams: dict[str, Any] = {}
    for name in ["tiny", *ADAPTERS]:  # greedy rows without any processing, next to them
        for i, prompt in enumerate(PROMPTS):
            streams[f"plain {name} {i}"] = engine.submit(
                name, PromptInput(token_ids=tuple(prompt)), SamplingParams(max_tokens=new))
    for j, (name, i, params, _) in enumerate(cases):
        streams[f"case {j}"] = engine.submit(
            name, PromptInput(token_ids=tuple(PROMPTS[i])),
            dataclasses.replace(params, max_tokens=new))
    streams["sampled"] = engine.submit(  # a sampled row with penalties and logprobs too
        "mlp-r8", PromptInput(token_ids=tuple(PROMPTS[0])),
        SamplingParams(temperature=0.9, seed=5, frequency_penalty=1.0, logprobs=3,
                       max_tokens=new))
    greedy_lp = engine.submit("attn-r4", PromptInput(token_ids=tuple(PROMPTS[1])),
                              SamplingParams(max_tokens=new, logprobs=4))
    engine.start()
    got = {key: [t for event in stream for t in event.token_ids] for key, stream in streams.items()}
    for name in ["tiny", *ADAPTERS]:
        for i in range(len(PROMPTS)):
            expected = reference[("base" if name == "tiny" else name, i)]
            assert got[f"plain {name} {i}"] == expected, (name, i)
    for j, (name, i, _, processors) in enumerate(cases):
        model = peft_model(tiny_model, None if name == "tiny" else tiny_adapters[name])
        expected = _hf_tokens(model, PROMPTS[i], new, processors)
        assert got[f"case {j}"] == expected, (name, i)
        plain = reference[("base" if name == "tiny" else name, i)]
        assert expected != plain, f"case {j} does not change the output: it proves nothing"
    assert len(got["sampled"]) >= 1
    events = list(greedy_lp)
    entries = [lp for event in events for lp in event.logprobs]
    tokens = [t for event in events for t in event.token_ids]
    assert [e.token_id for e in entries] == tokens == reference[("attn-r4", 1)]
    model = peft_model(tiny_model, tiny_adapters["attn-r4"])
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[1] + tokens])).logits[0].double()  # [L, V]
    exact = torch.log_softmax(logits[len(PROMPTS[1]) - 1 : -1], -1)  # [N, V]
    for n, entry in enumerate(entries):
        assert len(entry.top) == 4 and entry.top[0].logprob == entry.logprob
        assert entry.logprob == pytest.approx(exact[n, entry.token_id].item(), abs=1e-4)
        assert [t.token_id for t in entry.top] == exact[n].topk(4).indices.tolist()
        decode = engine.tokenizer.decode  # type: ignore[attr-defined]  # a transformers tokenizer, typed object
        assert entry.token == decode([entry.token_id])
        assert all(math.isfinite(t.logprob) for t in entry.top)
