"""vLLM's and SGLang's sampling extensions, one transform at a time against a plain reference:
min_p (with top-k, top-p and temperature, in vLLM's order), the repetition penalty and
min_tokens (with logit_bias and OpenAI's penalties), on random logits with ties, -inf from
masks and rows of different settings in one batch; and their checks at the door."""

from __future__ import annotations

import math

import pytest
import torch

from radixkv import SamplingParams
from radixkv.cache import PackedTokens
from radixkv.engine.sampling.penalties import RowTokens, adjust_logits, prompt_token_mask
from radixkv.engine.sampling.sampler import _filtered_probs, make_generator, sample

VOCAB = 40
INF = float("inf")


def random_logits(rows: int, seed: int) -> torch.Tensor:
    """Random rows with ties (repeated values, the top token's included) and -inf entries (a
    grammar's mask) in every other row."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=gen) * 2
    logits[:, 7] = logits.max(dim=-1).values + 1.0
    logits[:, 10:20] = logits[:, 0:10]  # ten tied pairs per row, (7, 17) the top
    logits[1::2, 25:35] = -INF
    return logits


def reference_probs(row: list[float], p: SamplingParams) -> list[float]:
    """vLLM's order, token by token: softmax(logits / T); keep the tokens with probability >=
    min_p x the top one's; then the top k of them (ties in index order); then, renormalised,
    each token whose mass before it is < top_p."""
    top = max(row)
    scaled = [(x - top) / p.temperature for x in row]
    total = sum(math.exp(x) for x in scaled)
    probs = [math.exp(x) / total for x in scaled]
    order = sorted(range(len(row)), key=lambda t: (-row[t], t))
    kept = [t for t in order if probs[t] >= p.min_p * probs[order[0]]]
    kept = kept[: p.top_k or len(kept)]
    mass = sum(probs[t] for t in kept)
    out, before = [0.0] * len(row), 0.0
    for t in kept:
        if before >= p.top_p and t != kept[0]:
            break
        out[t] = probs[t] / mass
        before += out[t]
    norm = sum(out)
    return [q / norm for q in out]


MIXED = [
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.7, min_p=0.05, top_k=12),
    SamplingParams(temperature=1.0, min_p=1.0),  # only the tied top tokens
    SamplingParams(temperature=1.5, min_p=0.1, top_p=0.8),
    SamplingParams(temperature=1.0),  # no filter, in a batch with filters
    SamplingParams(temperature=0.5, top_k=5, top_p=0.9, min_p=0.3),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_min_p_with_top_k_and_top_p_equals_the_reference(seed) -> None:
    logits = random_logits(len(MIXED), seed)
    got = _filtered_probs(logits, MIXED)
    for i, p in enumerate(MIXED):
        want = reference_probs(logits[i].tolist(), p)
        kept = [t for t, q in enumerate(want) if q > 0]
        assert got[i].nonzero()[:, 0].tolist() == kept, (i, p)
        assert got[i].tolist() == pytest.approx(want, abs=1e-6), (i, p)
    assert got[2].nonzero()[:, 0].tolist() == [7, 17]  # min_p = 1 keeps exactly the tied top


def test_draws_never_fall_below_the_min_p_threshold_and_repeat_with_the_seed() -> None:
    logits = random_logits(4, seed=5)
    params = [SamplingParams(temperature=t, min_p=m) for t, m in [(1, 0.3), (2, 0.1)]] * 2
    probs = torch.softmax(logits[:, None, :] / torch.tensor([1.0, 2.0])[None, :, None], -1)
    seen: set[tuple[int, int]] = set()
    for seed in range(60):
        tokens = sample(logits, params, [make_generator(seed + 10 * i) for i in range(4)])
        again = sample(logits, params, [make_generator(seed + 10 * i) for i in range(4)])
        assert tokens == again
        for i, (t, p) in enumerate(zip(tokens, params, strict=True)):
            row = probs[i, i % 2]
            assert row[t] >= p.min_p * row.max(), (seed, i, t)
            seen.add((i, t))
    # The filter leaves several tokens, and the draws visit more than one of them.
    assert len({t for i, t in seen if i == 1}) > 1
    unfiltered = [SamplingParams(temperature=1.0)] * 4
    free = {sample(logits, unfiltered, [make_generator(s)] * 4)[0] for s in range(60)}
    assert any(probs[0, 0, t] < 0.3 * probs[0, 0].max() for t in free)  # what min_p removes


def test_greedy_rows_ignore_min_p() -> None:
    logits = random_logits(3, seed=6)
    params = [SamplingParams(min_p=0.9), SamplingParams(), SamplingParams(min_p=0.5, top_k=3)]
    assert sample(logits, params, [None] * 3) == logits.argmax(-1).tolist()


def reference_adjusted(
    row: list[float], p: SamplingParams, prompt: list[int], output: list[int], stops: list[int]
) -> list[float]:
    """vLLM's order, token by token: min_tokens, logit_bias, repetition, frequency/presence."""
    row = list(row)
    others = any(math.isfinite(x) for t, x in enumerate(row) if t not in stops)
    if len(output) < p.min_tokens and others:
        for s in stops:
            row[s] = -INF
    for t, b in p.logit_bias:
        row[t] += b
    r = p.repetition_penalty
    for t in set(prompt) | set(output):
        row[t] = row[t] / r if row[t] > 0 else row[t] * r
    for t in set(output):
        row[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return row


ADJUSTED = [
    # (params, prompt, known output, in-flight token or None, stop tokens)
    (SamplingParams(repetition_penalty=1.3), [3, 5, 5, 9], [12, 3], 22, [2]),
    (SamplingParams(repetition_penalty=0.6, min_tokens=4), [1, 30, 31], [7], None, [2, 11]),
    (SamplingParams(), [4, 4], [4], 5, [2]),  # neutral among the others
    (SamplingParams(min_tokens=3, max_tokens=9), [8], [26, 27], None, [26, 2]),  # a grammar row
    (
        SamplingParams(
            repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.2, logit_bias={3: 2}
        ),
        [3, 33, 34],
        [16, 16, 6],
        6,
        [2],
    ),
    (SamplingParams(min_tokens=2), [9], [15], 16, [2]),  # reached: nothing held back
]


@pytest.mark.parametrize("seed", [0, 1])
def test_repetition_penalty_and_min_tokens_equal_the_reference(seed) -> None:
    logits = random_logits(len(ADJUSTED), seed)
    logits[3, :] = -INF  # a grammar that allows only stop token 26 and token 27
    logits[3, 26], logits[3, 27] = 1.0, 0.5
    rows = []
    for p, prompt, known, flying, stops in ADJUSTED:
        mask = (
            prompt_token_mask(PackedTokens(prompt), VOCAB, logits.device)
            if p.repetition_penalty != 1
            else None
        )
        in_flight = None if flying is None else torch.tensor([flying])
        rows.append(RowTokens(known, in_flight, mask, frozenset(stops)))
    got = adjust_logits(logits, [a[0] for a in ADJUSTED], rows)
    for i, (p, prompt, known, flying, stops) in enumerate(ADJUSTED):
        output = known + ([] if flying is None else [flying])
        want = reference_adjusted(logits[i].tolist(), p, prompt, output, stops)
        assert got[i].tolist() == pytest.approx(want, abs=1e-5), i
    assert torch.equal(got[2], logits[2]) and torch.equal(got[5], logits[5])
    assert got[3, 26] == -INF and got[3, 27] == 0.5  # held back: 27 is left
    assert (got[1, [2, 11]] == -INF).all()


def test_min_tokens_leaves_the_stop_tokens_when_nothing_else_is_left() -> None:
    logits = torch.full((1, VOCAB), -INF)
    logits[0, 2] = 0.3  # a grammar that can only end
    p = SamplingParams(min_tokens=5, max_tokens=8)
    got = adjust_logits(logits, [p], [RowTokens([9], None, None, frozenset({2, 3}))])
    assert torch.equal(got, logits)
    assert sample(got, [p], [None]) == [2]


def test_neutral_rows_and_reached_min_tokens_leave_the_logits_alone() -> None:
    logits = random_logits(2, seed=3)
    params = [SamplingParams(min_tokens=2), SamplingParams(repetition_penalty=1.0)]
    rows = [RowTokens([5, 6], None, None, frozenset({2})), RowTokens([], None, None, frozenset())]
    assert adjust_logits(logits, params, rows) is logits


def test_prompt_token_mask_marks_each_prompt_token_once() -> None:
    mask = prompt_token_mask(PackedTokens([5, 3, 5, 39, 0]), VOCAB, torch.device("cpu"))
    assert mask.dtype == torch.bool and mask.shape == (VOCAB,)
    assert mask.nonzero()[:, 0].tolist() == [0, 3, 5, 39]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(min_p=1.5), ValueError, "min_p"),
        (dict(min_p=-0.1), ValueError, "min_p"),
        (dict(min_p=float("nan")), ValueError, "min_p"),
        (dict(min_p="0.1"), TypeError, "min_p"),
        (dict(min_p=True), TypeError, "min_p"),
        (dict(repetition_penalty=0), ValueError, "repetition_penalty"),
        (dict(repetition_penalty=-1.1), ValueError, "repetition_penalty"),
        (dict(repetition_penalty=float("inf")), ValueError, "repetition_penalty"),
        (dict(repetition_penalty=None), TypeError, "repetition_penalty"),
        (dict(min_tokens=-1), ValueError, "min_tokens"),
        (dict(min_tokens=2.0), TypeError, "min_tokens"),
        (dict(min_tokens=10, max_tokens=9), ValueError, "min_tokens"),
        (dict(top_k=-1), ValueError, "top_k"),
    ],
)
def test_bad_values_are_refused_naming_the_field(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


def test_what_each_extension_turns_on() -> None:
    assert not SamplingParams().adjusts_logits_at(0)
    assert not SamplingParams(min_p=0.5, top_k=3).adjusts_logits_at(0)  # a sampler filter
    assert SamplingParams(repetition_penalty=1.05).adjusts_logits_at(100)
    p = SamplingParams(min_tokens=3)
    assert p.adjusts_logits_at(2) and not p.adjusts_logits_at(3) and not p.adjusts_logits
    assert SamplingParams(min_tokens=4, max_tokens=4).min_tokens == 4
