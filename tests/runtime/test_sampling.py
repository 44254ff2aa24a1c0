"""Sampling filters against a direct computation and against transformers' logits processors."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from headwise import SamplingParams
from headwise.runtime.sampling import apply_repetition_penalty, filter_logits
from headwise.runtime.sampler import sample

from transformers.generation.logits_process import (  # noqa: E402  (the independent reference)
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


def logits_strategy():
    return st.integers(0, 2**16).map(lambda s: torch.randn(3, 50, generator=torch.Generator().manual_seed(s)) * 3)


def kept(logits):
    return [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in logits]


@given(logits=logits_strategy(), k=st.integers(1, 50))
def test_top_k_keeps_exactly_the_k_largest(logits, k):
    expect = [set(row.argsort(descending=True)[:k].tolist()) for row in logits]
    assert kept(filter_logits(logits, top_k=k)) == expect


@given(logits=logits_strategy(), p=st.floats(0.01, 0.99))
def test_top_p_keeps_the_smallest_set_reaching_p(logits, p):
    expect = []
    for row in logits:
        probs, order = row.softmax(-1).sort(descending=True)
        keep, total = set(), 0.0
        for prob, idx in zip(probs.tolist(), order.tolist()):
            keep.add(idx)
            total += prob
            if total >= p:
                break
        expect.append(keep)
    got = kept(filter_logits(logits, top_p=p))
    # float32 cumulative sums may differ from Python floats right at the boundary
    for g, e in zip(got, expect):
        assert g == e or len(g ^ e) == 1


@given(logits=logits_strategy(), m=st.floats(0.0, 1.0))
def test_min_p_keeps_tokens_above_fraction_of_max(logits, m):
    probs = logits.softmax(-1)
    expect = [set(torch.nonzero(row >= m * row.max()).flatten().tolist()) for row in probs]
    assert kept(filter_logits(logits, min_p=m)) == expect


@given(logits=logits_strategy(), k=st.integers(1, 50), p=st.floats(0.05, 1.0), m=st.floats(0.0, 0.5))
def test_filters_match_transformers_warpers(logits, k, p, m):
    ids = torch.zeros(3, 1, dtype=torch.long)
    ref = TopKLogitsWarper(k)(ids, logits.clone())
    ref = TopPLogitsWarper(p)(ids, ref) if p < 1.0 else ref
    ref = MinPLogitsWarper(m)(ids, ref) if m > 0 else ref
    ours = filter_logits(logits, top_k=k, top_p=p, min_p=m)
    for g, e in zip(kept(ours), kept(ref)):
        assert g == e or len(g ^ e) == 1  # boundary ties in float32 cumulative sums


@given(logits=logits_strategy(), penalty=st.floats(0.5, 2.0))
def test_repetition_penalty_matches_transformers(logits, penalty):
    ids = torch.tensor([[1, 5, 5, 7], [0, 2, 3, 4], [49, 48, 1, 1]])
    seen = torch.zeros(3, 50, dtype=torch.bool).scatter(1, ids, True)
    ref = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    assert torch.allclose(apply_repetition_penalty(logits, seen, penalty), ref)


def test_greedy_is_argmax_and_seeds_reproduce():
    logits = torch.randn(4, 100)
    assert torch.equal(sample(logits, SamplingParams(temperature=0)), logits.argmax(-1))
    params = SamplingParams(temperature=1.0)
    draw = lambda seed: [
        sample(logits, params, generator=torch.Generator().manual_seed(seed)).tolist()  # noqa: E731
        for _ in range(5)
    ]
    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


def test_sampling_only_draws_allowed_tokens():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0, 2.8]])
    g = torch.Generator().manual_seed(0)
    draws = {int(sample(logits, SamplingParams(top_k=2), generator=g)) for _ in range(300)}
    assert draws == {0, 1}


def test_bad_sampling_params():
    with pytest.raises(ValueError, match="top_p must be in \\(0, 1\\], got 1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        SamplingParams(max_new_tokens=0)
    assert SamplingParams(stop="###").stop == ("###",)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1e-300),
        SamplingParams(temperature=1e-30, top_p=0.5),
        SamplingParams(temperature=1.0, repetition_penalty=1e-193),
        SamplingParams(temperature=1e-300, repetition_penalty=1e30, min_p=0.5),
    ],
)
def test_extreme_parameters_never_produce_nan(params):
    """Overflow-prone settings sample a real token: argmax of the penalized logits (a tiny
    temperature) or any allowed token, never a multinomial error on NaN/inf."""
    logits = torch.randn(4, 100) * 5
    seen = torch.zeros(4, 100, dtype=torch.bool)
    seen[:, :10] = True
    got = sample(logits, params, seen=seen, generator=torch.Generator().manual_seed(0))
    assert got.shape == (4,) and ((0 <= got) & (got < 100)).all()
    if params.temperature < 1e-20:
        ref = apply_repetition_penalty(logits, seen, params.repetition_penalty).argmax(-1)
        assert torch.equal(got, ref)
