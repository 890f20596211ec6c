"""The batched sampler: greedy is argmax, the top-k / top-p filters are HF's, draws follow the
softmax, a seeded request is reproducible whatever shares its batch, and bad parameters are
refused with a message that says what to fix."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from lorastream.core.errors import InvalidArgument
from lorastream.worker.engine import sampling
from lorastream.worker.engine.sampling import (
    Sampler,
    SamplingParams,
    SamplingRow,
    filter_weights_,
    inverse_cdf,
    make_generator,
)
from tests.support.sync_free import TorchCallLog

VOCAB = 1000


def random_logits(
    batch: int, vocab: int = VOCAB, scale: float = 3.0, seed: int = 0
) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=generator) * scale  # [B, V]


def rows_of(params: SamplingParams, batch: int) -> list[SamplingRow]:
    return [SamplingRow(params, make_generator(params.seed)) for _ in range(batch)]


def test_greedy_rows_stay_argmax_in_a_batch_with_sampled_rows() -> None:
    logits = random_logits(16, scale=0.5, seed=6)
    rows = [
        SamplingRow(SamplingParams(temperature=float(i % 2), top_k=10 * (i % 3)))
        for i in range(16)
    ]
    tokens = Sampler().sample(logits, rows)
    assert torch.equal(tokens[0::2], logits[0::2].argmax(-1))
    assert not torch.equal(tokens[1::2], logits[1::2].argmax(-1))


@pytest.mark.parametrize("batch", [1, 7, 64])
def test_greedy_rows_take_the_argmax_lowest_index_on_ties(batch: int) -> None:
    logits = random_logits(batch).round()  # rounding makes ties at the top likely
    logits[0, 3] = logits[0, 5] = logits[0].max() + 1  # a certain tie: index 3 wins
    tokens = Sampler().sample(logits, rows_of(SamplingParams(), batch))
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert tokens[0] == 3


def test_greedy_decoding_matches_hf_generate() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.support.models import TINY_LLAMA

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).eval()
    prompt = [5, 9, 33, 41, 7]
    with torch.no_grad():
        expected = model.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )[0, len(prompt):].tolist()
        ids, sampler = list(prompt), Sampler()
        for _ in expected:
            logits = model(torch.tensor([ids])).logits[:, -1, :]  # [1, V]
            ids.append(int(sampler.sample(logits, rows_of(SamplingParams(), 1))[0]))
    assert ids[len(prompt):] == expected


def test_all_greedy_batch_runs_a_single_argmax() -> None:
    logits, sampler, rows = random_logits(32), Sampler(), rows_of(SamplingParams(), 32)
    with TorchCallLog() as log:
        sampler.sample(logits, rows)
    assert [c for c in log.calls if c not in {"dim", "__get__", "shape"}] == ["argmax"]


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0, 100.0])
def test_top_k_1_equals_greedy_at_any_temperature(temperature: float) -> None:
    logits = random_logits(64, seed=1)
    params = SamplingParams(temperature=temperature, top_k=1)
    assert torch.equal(Sampler().sample(logits, rows_of(params, 64)), logits.argmax(-1))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 50.0])
def test_tiny_top_p_keeps_only_the_top_token(temperature: float) -> None:
    logits = random_logits(64, seed=2)
    params = SamplingParams(temperature=temperature, top_p=1e-6)
    assert torch.equal(Sampler().sample(logits, rows_of(params, 64)), logits.argmax(-1))


def test_temperature_below_epsilon_is_greedy() -> None:
    params = SamplingParams(temperature=sampling.GREEDY_TEMPERATURE / 2)
    assert params.greedy
    logits = random_logits(8, seed=3)
    assert torch.equal(Sampler().sample(logits, rows_of(params, 8)), logits.argmax(-1))


@pytest.mark.parametrize("nucleus_guess", [2, 256])  # 2: every top-p row needs wider candidates
@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [
        (1.0, 5, 1.0),
        (1.0, 50, 1.0),
        (0.7, 0, 0.9),
        (2.0, 0, 0.5),
        (1.0, 0, 0.999),
        (0.8, 40, 0.9),
        (1.5, 3, 0.2),
        (1.0, 5000, 0.95),  # top_k above the vocabulary is no filter (HF clamps it)
    ],
)
def test_kept_tokens_match_hf_temperature_top_k_top_p_warpers(
    temperature: float, top_k: int, top_p: float, nucleus_guess: int
) -> None:
    logits = random_logits(16, scale=2.0, seed=4)
    reference = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        reference = TopKLogitsWarper(top_k)(None, reference)
    if top_p < 1:
        reference = TopPLogitsWarper(top_p)(None, reference)
    weights = filter_weights_(
        logits / temperature, torch.full((16,), top_k), torch.full((16,), top_p), nucleus_guess
    )
    assert torch.equal(weights > 0, reference.isfinite())


def test_kept_tokens_match_hf_in_a_batch_mixing_parameters() -> None:
    settings = [(0, 1.0), (3, 1.0), (0, 0.8), (40, 0.9), (7, 0.5), (0, 0.95), (500, 0.99)]
    logits = random_logits(len(settings), scale=2.0, seed=5)
    top_k = torch.tensor([k for k, _ in settings])
    top_p = torch.tensor([p for _, p in settings])
    kept = filter_weights_(logits.clone(), top_k, top_p, nucleus_guess=16) > 0
    for row, (k, p) in enumerate(settings):
        reference = logits[row : row + 1].clone()
        reference = TopKLogitsWarper(k)(None, reference) if k else reference
        reference = TopPLogitsWarper(p)(None, reference) if p < 1 else reference
        assert torch.equal(kept[row], reference[0].isfinite()), (k, p)


def test_top_p_nucleus_ends_where_the_mass_before_a_token_reaches_top_p_like_hf() -> None:
    # probabilities .5 .25 .125 .125: the mass before the third token is exactly top_p
    logits = torch.tensor([[0.0, math.log(0.5), math.log(0.25), math.log(0.25)]])
    reference = TopPLogitsWarper(0.75)(None, logits.clone())
    weights = filter_weights_(logits.clone(), torch.tensor([0]), torch.tensor([0.75]))
    assert (weights > 0).tolist() == reference.isfinite().tolist() == [[True, True, False, False]]


def test_top_k_keeps_every_token_tied_with_the_kth_like_hf() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 3.0, 3.0, 1.0]])
    reference = TopKLogitsWarper(3)(None, logits.clone())
    weights = filter_weights_(logits.clone(), torch.tensor([3]), torch.tensor([1.0]))
    assert (weights > 0).tolist() == reference.isfinite().tolist() == [[True] * 5 + [False]]


@pytest.mark.parametrize(
    ("top_k", "top_p", "kept"),
    [(0, 1.0, 8), (3, 1.0, 3), (0, 0.7, None), (4, 0.8, None)],
    ids=["plain", "top-k", "top-p", "top-k+top-p"],
)
def test_temperature_1_draws_follow_the_filtered_softmax(
    top_k: int, top_p: float, kept: int | None
) -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    probs = filter_weights_(logits[None].clone(), torch.tensor([top_k]), torch.tensor([top_p]))[0]
    probs = probs / probs.sum()
    if kept is not None:
        assert int((probs > 0).sum()) == kept
    torch.manual_seed(1234)
    draws, batch = 40_000, 4_000
    rows = rows_of(SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p), batch)
    sampler = Sampler()
    counts = torch.zeros(8)
    for _ in range(draws // batch):
        tokens = sampler.sample(logits.expand(batch, 8).contiguous(), rows)
        counts += torch.bincount(tokens, minlength=8)
    assert counts[probs == 0].sum() == 0, "a filtered-out token was drawn"
    expected = probs[probs > 0] * draws
    chi2 = float(((counts[probs > 0] - expected) ** 2 / expected).sum())
    dof = int((probs > 0).sum()) - 1
    assert chi2 < dof + 6 * math.sqrt(2 * dof), f"chi2={chi2:.1f} with {dof} degrees of freedom"


def _companions(batch: int, seed: int) -> list[SamplingRow]:
    """Rows of every kind: greedy, unseeded, other seeds, top-k, top-p."""
    kinds = [
        SamplingParams(),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=20, seed=seed + 1),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=0.9, top_k=5, top_p=0.9, seed=seed + 2),
    ]
    return [SamplingRow(kinds[i % 5], make_generator(kinds[i % 5].seed)) for i in range(batch)]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=7),
        SamplingParams(temperature=0.8, top_k=50, seed=8),
        SamplingParams(temperature=1.2, top_p=0.9, seed=9),
    ],
    ids=["plain", "top-k", "top-p"],
)
@pytest.mark.parametrize(("companions", "position"), [(0, 0), (3, 1), (40, 17), (40, 40)])
def test_seeded_request_is_reproducible_whatever_its_batch_companions(
    params: SamplingParams, companions: int, position: int
) -> None:
    steps = [random_logits(1, scale=2.0, seed=100 + i) for i in range(6)]  # [1, V] per step

    def run(companions: int, position: int) -> list[int]:
        generator, others = make_generator(params.seed), _companions(companions, 3)
        sampler = Sampler()
        tokens = []
        for step, logits in enumerate(steps):
            batch = random_logits(companions + 1, seed=step)
            batch[position] = logits[0]
            rows = [*others[:position], SamplingRow(params, generator), *others[position:]]
            tokens.append(int(sampler.sample(batch, rows)[position]))
        return tokens

    assert run(companions, position) == run(0, 0)


def test_different_seeds_give_different_tokens() -> None:
    logits = random_logits(1, scale=0.1).expand(20, VOCAB).contiguous()  # near uniform
    rows = [
        SamplingRow(SamplingParams(temperature=1.0, seed=s), make_generator(s)) for s in range(20)
    ]
    assert len(set(Sampler().sample(logits, rows).tolist())) > 10


@pytest.mark.parametrize("block", [3, 4, 1024])  # V = 10: ragged tail, exact blocks, one block
@pytest.mark.parametrize(
    ("u", "expected"), [(0.0, 2), (0.3, 2), (0.5, 5), (0.99, 9), (1.0 - 2**-53, 9)]
)
def test_inverse_cdf_picks_by_cumulative_weight_and_never_a_zero_weight_token(
    block: int, u: float, expected: int
) -> None:
    weights = torch.tensor([[0.0, 0.0, 4.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0, 4.0]])  # cdf .4 .6 1
    uniform = torch.tensor([u], dtype=torch.float64)
    assert inverse_cdf(weights, uniform, block).tolist() == [expected]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(temperature=-1), "temperature must be >= 0, got -1"),
        (SamplingParams(temperature=math.nan), "temperature must be a finite number"),
        (SamplingParams(temperature=math.inf), "temperature must be a finite number"),
        (SamplingParams(temperature="hot"), "temperature must be a number"),  # type: ignore[arg-type]  # a wrong type on purpose
        (SamplingParams(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
        (SamplingParams(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
        (SamplingParams(top_p=-math.inf), "top_p must be a finite number"),
        (SamplingParams(top_k=-1), "top_k must be 0 (disabled) or >= 1, got -1"),
        (SamplingParams(top_k=2.5), "top_k must be an integer"),  # type: ignore[arg-type]  # a wrong type on purpose
        (SamplingParams(max_tokens=0), "max_tokens must be >= 1, got 0"),
        (SamplingParams(max_tokens=True), "max_tokens must be an integer"),
        (SamplingParams(seed=-1), "seed must be in [0, 2**64 - 1], got -1"),
        (SamplingParams(seed=2**64), "seed must be in [0, 2**64 - 1]"),
        (SamplingParams(stop=("ok", "")), "stop strings must not be empty"),
        (SamplingParams(stop=tuple("x" * i for i in range(1, 18))), "at most 16 strings, got 17"),
        (SamplingParams(stop="END"), "wrap a single stop string in a list"),  # type: ignore[arg-type]  # a wrong type on purpose
        (SamplingParams(stop=("a", 3)), "stop strings must be strings"),  # type: ignore[arg-type]  # a wrong type on purpose
        (SamplingParams(stop=("x" * 1025,)), "at most 1024 characters"),
        (SamplingParams(stop_token_ids=(5, VOCAB)), f"in [0, {VOCAB - 1}] (the vocabulary), got"),
        (SamplingParams(stop_token_ids=(-1,)), "stop_token_ids must be in [0, 999]"),
        (SamplingParams(ignore_eos=1), "ignore_eos must be a bool"),  # type: ignore[arg-type]  # a wrong type on purpose
        (SamplingParams(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5"),
        (SamplingParams(frequency_penalty=-3), "frequency_penalty must be in [-2, 2], got -3"),
        (SamplingParams(frequency_penalty=math.nan), "frequency_penalty must be a finite"),
        (SamplingParams(repetition_penalty=0), "repetition_penalty must be > 0 (1 disables)"),
        (SamplingParams(logit_bias=((VOCAB, 1.0),)), "logit_bias keys must be token ids in"),
        (SamplingParams(logit_bias=((5, 101.0),)), "logit_bias values must be in [-100, 100]"),
        (SamplingParams(logit_bias=((5, 1.0), (5, 2.0))), "logit_bias names token 5 twice"),
        (SamplingParams(logit_bias=tuple((i, 1.0) for i in range(1025))), "at most 1024 tokens"),
        (SamplingParams(min_tokens=-1), "min_tokens must be >= 0, got -1"),
        (SamplingParams(min_tokens=9, max_tokens=8), "min_tokens (9) must be <= max_tokens (8)"),
        (SamplingParams(logprobs=21), "logprobs (the number of top log-probabilities) must be"),
        (SamplingParams(logprobs=-1), "must be in [0, 20], got -1"),
    ],
)
def test_invalid_parameters_raise_invalid_argument_saying_what_to_fix(
    params: SamplingParams, message: str
) -> None:
    with pytest.raises(InvalidArgument) as error:
        params.validate(VOCAB)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=2, top_p=1, top_k=VOCAB * 2, max_tokens=1, seed=0),
        SamplingParams(top_p=1e-9, seed=2**64 - 1, stop=tuple("abcdefghijklmnop")),
        SamplingParams(stop_token_ids=(0, VOCAB - 1), ignore_eos=True),
        SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.01,
                       logit_bias=((0, -100.0), (VOCAB - 1, 100.0)), min_tokens=256,
                       logprobs=20),
        SamplingParams(logprobs=0, min_tokens=0, repetition_penalty=1),
    ],
)
def test_valid_parameters_pass_validation(params: SamplingParams) -> None:
    params.validate(VOCAB)
