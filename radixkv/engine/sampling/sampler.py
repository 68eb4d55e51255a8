"""Token sampling: greedy, temperature, min-p, top-k, top-p, each request with its own random
stream.

Masking is vectorised over the batch (per-row temperature / k / p as tensors), and so is the draw.
Every request owns a `random.Random` seeded from its own seed, which gives one uniform number per
sampled token on the host; the batch's tokens then come from one inverse-CDF lookup on the device
(per row, the first token whose cumulative probability passes the row's number), after one small
copy of the numbers. A seeded request draws the same numbers whatever else shares its batch, so it
samples the same tokens, on the CPU and on a GPU alike.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixkv.engine.sampling_params import SamplingParams


def make_generator(seed: int) -> random.Random:
    """A request's random stream: one number per sampled token. `random.Random` hashes the whole
    integer, so seeds that differ in any bit (0, 2**32, 2**63) give different streams."""
    return random.Random(seed)


@dataclass(frozen=True, slots=True)
class Draw:
    """One step's draw, on the logits' device: a token per row, and per row whether its
    probabilities were usable (finite, some mass; greedy rows always are); `faults`: rows whose
    draw raised on the host, by index (their tokens are placeholders)."""

    tokens: torch.Tensor  # [num_rows] int64
    usable: torch.Tensor  # [num_rows] bool
    faults: dict[int, Exception]

    def packed(self) -> torch.Tensor:
        """The tokens, then the usable flags as 0 / 1: one tensor, to be read back at once."""
        return torch.cat([self.tokens, self.usable.to(self.tokens.dtype)])

    def results(self, packed: list[int]) -> list[int | Exception]:
        """Per row, from `packed()` as read back: its token, or the exception that fails it."""
        n = len(packed) // 2
        results: list[int | Exception] = packed[:n]
        for i, usable in enumerate(packed[n:]):
            if i in self.faults:
                results[i] = self.faults[i]
            elif not usable:
                results[i] = RuntimeError("the row's probabilities are not finite")
        return results


def draw(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[random.Random | None],
) -> Draw:
    """Pick one token per row, without reading anything back: on CUDA nothing waits for the
    device (the host numbers travel through pinned memory). logits: [num_rows, vocab] (fp32). A
    row whose params are greedy takes the argmax and needs no generator; every other row needs
    one.

    One request's fault is its own: a row whose probabilities are not finite is marked unusable,
    and a fault in the work the rows share, raised before any generator is drawn from, is
    narrowed down by drawing each row alone.
    """
    assert len(params) == logits.shape[0] == len(generators), "one params and generator per row"
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    try:
        probs = _probs_of(logits, params, sampled_rows)
    except Exception as exc:
        if len(params) == 1:
            return Draw(logits.argmax(dim=-1), _all_usable(logits), {0: exc})
        alone = [
            draw(logits[i : i + 1], [p], [g])
            for i, (p, g) in enumerate(zip(params, generators, strict=True))
        ]
        faults = {i: d.faults[0] for i, d in enumerate(alone) if d.faults}
        tokens = torch.cat([d.tokens for d in alone])
        return Draw(tokens, torch.cat([d.usable for d in alone]), faults)
    tokens = _pick(logits, probs, sampled_rows, generators)
    usable = _all_usable(logits)
    if sampled_rows:
        rows = host_values_on(logits.device, sampled_rows, torch.int64)
        usable[rows] = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)
    return Draw(tokens, usable, {})


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[random.Random | None],
) -> list[int | Exception]:
    """`draw`, read back: each row's token, or the exception that failed the row."""
    drawn = draw(logits, params, generators)
    return drawn.results(drawn.packed().tolist())


def _all_usable(logits: torch.Tensor) -> torch.Tensor:
    return torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)


def _probs_of(
    logits: torch.Tensor, params: Sequence[SamplingParams], sampled_rows: list[int]
) -> torch.Tensor:
    """The sampled rows' filtered probabilities, [len(sampled_rows), vocab]."""
    if not sampled_rows:
        return logits[:0]
    return _filtered_probs(logits[sampled_rows], [params[i] for i in sampled_rows])


def _pick(
    logits: torch.Tensor,
    probs: torch.Tensor,
    sampled_rows: list[int],
    generators: Sequence[random.Random | None],
) -> torch.Tensor:
    """The argmax of every row, with the sampled rows' tokens drawn from `probs` over it."""
    tokens = logits.argmax(dim=-1)
    if sampled_rows:
        uniforms = []
        for i in sampled_rows:
            gen = generators[i]
            assert gen is not None, f"row {i} samples but has no generator"
            uniforms.append(gen.random())
        rows = host_values_on(logits.device, sampled_rows, torch.int64)
        tokens[rows] = _draw(probs, host_values_on(logits.device, uniforms, torch.float32))
    return tokens


def host_values_on(
    device: torch.device, values: Sequence[float], dtype: torch.dtype
) -> torch.Tensor:
    """A small host list as a tensor on `device`. On CUDA through pinned memory, without a
    synchronization: a pageable copy would wait for the work queued before it."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: per row, the first token whose cumulative probability exceeds
    `uniforms[row]` (in [0, 1)) times the row's total. probs: [n, vocab] -> token ids [n].

    A token of zero probability is never drawn: its cumulative value is set to its predecessor's
    (a parallel scan on a GPU may leave it an ulp-wide step above), and a number that rounds up to
    the total picks the last token with mass."""
    cdf = probs.cumsum(dim=-1)
    cdf = torch.where(probs > 0, cdf, float("-inf")).cummax(dim=-1).values
    total = cdf[:, -1:].contiguous()
    picked = torch.searchsorted(cdf, uniforms.to(cdf.dtype)[:, None] * total, right=True)
    last_with_mass = torch.searchsorted(cdf, total)
    return torch.minimum(picked, last_with_mass).squeeze(1)


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Softmax of logits / temperature restricted to the min-p set, the top-k and the top-p
    nucleus, per row, in vLLM's order: min-p and top-k on the tempered distribution, top-p on
    what they leave. logits: [n, vocab] -> probabilities [n, vocab] (renormalised, zero outside
    the kept set)."""
    vocab = logits.shape[1]
    dev = logits.device
    temps = host_values_on(dev, [p.temperature for p in params], torch.float32)
    # Shifted so the best logit is 0: a temperature too small for fp32 (1e-50 rounds to 0, or
    # underflows the quotient) then sends the others to -inf, the greedy limit, instead of NaN.
    logits = logits.float()
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    scaled = shifted / temps.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
    top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_ps = [p.top_p for p in params]
    min_ps = [p.min_p for p in params]
    if all(k == vocab for k in top_ks) and all(p >= 1.0 for p in top_ps) and not any(min_ps):
        return torch.softmax(scaled, dim=-1)
    # Sort once; the filters are prefixes of the descending order. Stable sort keeps ties in
    # index order, so top-k=1 and a tiny top-p pick the same token as argmax.
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=dev)[None, :]
    k = host_values_on(dev, top_ks, torch.int64)[:, None]
    drop = rank >= k
    if any(min_ps):
        drop = drop | _below_min_p(sorted_logits, host_values_on(dev, min_ps, torch.float32))
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    p = host_values_on(dev, top_ps, torch.float32)[:, None]
    # Keep a token when the mass strictly before it is < top_p: the most likely token always stays.
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop = drop | (mass_before >= p)
    drop[:, 0] = False  # even a top_p that rounds to 0 in fp32
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)


def _below_min_p(sorted_logits: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Where a token's probability is below min_p times its row's top probability (vLLM's
    min-p; the top token, and any tied with it, always stays). sorted_logits: [n, vocab] in
    descending order, min_ps: [n] -> [n, vocab] bool."""
    probs = torch.softmax(sorted_logits, dim=-1)
    return probs < min_ps[:, None] * probs[:, :1]
