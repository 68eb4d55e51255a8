"""Token sampling: greedy, temperature, top-k, top-p, each request with its own RNG.

Masking is vectorised over the batch (per-row temperature / k / p as tensors); the final draw is
per row because every request owns a `torch.Generator` seeded from its own seed, so a seeded
request samples the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixkv.engine.sampling_params import SamplingParams


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """Pick one token per row. logits: [num_rows, vocab] (fp32). A row whose params are greedy
    takes the argmax and needs no generator; every other row needs one."""
    assert len(params) == logits.shape[0] == len(generators), "one params and generator per row"
    if not params:  # a step of non-final prefill chunks: `.tolist()` may wait for the GPU
        return []
    tokens = logits.argmax(dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=logits.device)
        probs = _filtered_probs(logits[rows], [params[i] for i in sampled_rows])
        for j, i in enumerate(sampled_rows):
            gen = generators[i]
            assert gen is not None, f"row {i} samples but has no generator"
            tokens[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
    return tokens.tolist()


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Softmax of logits / temperature restricted to the top-k and the top-p nucleus, per row.
    logits: [n, vocab] -> probabilities [n, vocab] (renormalised, zero outside the kept set)."""
    vocab = logits.shape[1]
    dev = logits.device
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
    # Shifted so the best logit is 0: a temperature too small for fp32 (1e-50 rounds to 0, or
    # underflows the quotient) then sends the others to -inf, the greedy limit, instead of NaN.
    logits = logits.float()
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    scaled = shifted / temps.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
    top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_ps = [p.top_p for p in params]
    if all(k == vocab for k in top_ks) and all(p >= 1.0 for p in top_ps):
        return torch.softmax(scaled, dim=-1)
    # Sort once; both filters are prefixes of the descending order. Stable sort keeps ties in
    # index order, so top-k=1 and a tiny top-p pick the same token as argmax.
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=dev)[None, :]
    k = torch.tensor(top_ks, device=dev)[:, None]
    drop = rank >= k
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    p = torch.tensor(top_ps, dtype=torch.float32, device=dev)[:, None]
    # Keep a token when the mass strictly before it is < top_p: the most likely token always stays.
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop = drop | (mass_before >= p)
    drop[:, 0] = False  # even a top_p that rounds to 0 in fp32
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)
