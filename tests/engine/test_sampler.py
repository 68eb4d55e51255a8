"""Sampler: greedy, temperature, top-k, top-p, per-request generators."""

from __future__ import annotations

import random

import pytest
import torch

from radixkv import SamplingParams
from radixkv.engine.sampling import sampler
from radixkv.engine.sampling.sampler import _draw, _filtered_probs, make_generator, sample

VOCAB = 50


def logits_rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def gens(n: int, seed: int = 0) -> list[random.Random]:
    return [make_generator(seed + i) for i in range(n)]


def test_greedy_is_argmax_and_needs_no_generator():
    logits = logits_rows(4)
    assert sample(logits, [SamplingParams()] * 4, [None] * 4) == logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=5.0, top_p=1e-6),
        SamplingParams(temperature=1.0, top_k=3, top_p=1e-6),
    ],
    ids=["top_k=1", "tiny top_p", "both"],
)
def test_degenerate_filters_equal_greedy(params):
    logits = logits_rows(8, seed=1)
    assert sample(logits, [params] * 8, gens(8)) == logits.argmax(-1).tolist()


def test_same_seed_same_tokens_whatever_the_batch():
    logits = logits_rows(6, seed=2)
    p = SamplingParams(temperature=1.0)
    alone = [sample(logits[i : i + 1], [p], [make_generator(7)])[0]
             for i in range(6)]  # fmt: skip
    batched = sample(logits, [p] * 6, [make_generator(7) for _ in range(6)])
    assert alone == batched
    # A mixed batch (greedy rows in between) leaves the sampled rows' draws unchanged.
    mixed = [p if i % 2 == 0 else SamplingParams() for i in range(6)]
    generators = [make_generator(7) if i % 2 == 0 else None for i in range(6)]
    got = sample(logits, mixed, generators)
    assert got[0::2] == batched[0::2]
    assert got[1::2] == logits[1::2].argmax(-1).tolist()


def test_top_k_keeps_exactly_k():
    logits = logits_rows(3, seed=3)
    probs = _filtered_probs(logits, [SamplingParams(temperature=1.0, top_k=5)] * 3)
    assert ((probs > 0).sum(-1) == 5).all()
    top5 = logits.topk(5).indices
    assert torch.equal(probs.gather(1, top5) > 0, torch.ones(3, 5, dtype=torch.bool))
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    for top_p, kept in [(0.5, 1), (0.51, 2), (0.8, 2), (0.81, 3), (0.96, 4), (1.0, 4)]:
        probs = _filtered_probs(logits, [SamplingParams(temperature=1.0, top_p=top_p)])
        assert int((probs > 0).sum()) == kept, top_p
    probs = _filtered_probs(logits, [SamplingParams(temperature=1.0, top_p=0.8)])
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))


def test_temperature_changes_the_distribution():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1])).expand(4000, 3).contiguous()

    def freq_of_top(temperature: float) -> float:
        p = SamplingParams(temperature=temperature)
        tokens = torch.tensor(sample(logits, [p] * len(logits), gens(len(logits))))
        return float((tokens == 0).float().mean())

    cold, neutral, hot = freq_of_top(0.3), freq_of_top(1.0), freq_of_top(3.0)
    assert abs(neutral - 0.6) < 0.04  # temperature 1 samples the model's distribution
    assert cold > 0.85 and hot < 0.5


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1e-50),
        SamplingParams(temperature=5e-324),
        SamplingParams(temperature=1e-40, top_k=5),
        SamplingParams(temperature=1.0, top_p=1e-50),
        SamplingParams(temperature=1.0, top_p=5e-324),
        SamplingParams(temperature=1e-50, top_p=1e-50, top_k=2),
    ],
    ids=["t=1e-50", "t=min float", "t=1e-40 top_k", "p=1e-50", "p=min float", "all tiny"],
)
def test_underflowing_values_sample_greedily(params):
    logits = logits_rows(8, seed=2)
    assert sample(logits, [params] * 8, gens(8)) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [1e30, 1e300, 1.7e308])
def test_huge_temperatures_sample_uniformly(temperature):
    logits = logits_rows(1, seed=3).expand(2000, VOCAB)
    params = [SamplingParams(temperature=temperature)] * 2000
    tokens = sample(logits, params, gens(2000))
    assert all(0 <= t < VOCAB for t in tokens)
    assert len(set(tokens)) == VOCAB  # every token drawn: 2000 draws of 50 equally likely


def test_one_draw_for_the_whole_batch(monkeypatch):
    """The batch's sampled rows are drawn by one batched lookup, whatever their number."""
    calls = []
    monkeypatch.setattr(sampler, "_draw", lambda p, u: calls.append(len(u)) or _draw(p, u))
    logits = logits_rows(16, seed=4)
    params = [SamplingParams(temperature=1.0, top_p=0.9 if i % 3 else 1.0) for i in range(16)]
    params[5] = SamplingParams()  # a greedy row in between
    sample(logits, params, [None if p.greedy else make_generator(i) for i, p in enumerate(params)])
    assert calls == [15]


def test_draws_follow_the_distribution_and_never_pick_a_zero():
    probs = torch.tensor([[0.0, 0.2, 0.0, 0.0, 0.5, 0.3, 0.0]])
    n = 6000
    gen = make_generator(3)
    uniforms = torch.tensor([gen.random() for _ in range(n)], dtype=torch.float64)
    tokens = _draw(probs.expand(n, -1), uniforms)
    counts = torch.bincount(tokens, minlength=7).double() / n
    assert counts[[0, 2, 3, 6]].sum() == 0
    torch.testing.assert_close(counts, probs[0].double(), atol=0.025, rtol=0)
    # The ends of [0, 1): the first and the last token with mass, never a zero past the end.
    edges = torch.tensor([0.0, 1.0 - 2**-53, 0.2, 0.7], dtype=torch.float64)
    assert _draw(probs.expand(4, -1), edges).tolist() == [1, 5, 4, 5]
