"""The logit adjustments a request may ask for, applied to a step's logits before sampling
(greedy rows included), in vLLM's order:

    logits[s] = -inf                      each stop token s, while the reply is shorter than
                                          min_tokens (vLLM's; EOS included unless ignore_eos)
    logits[t] += logit_bias[t]            (OpenAI's)
    logits[t] /= r  if logits[t] > 0      each token t in the prompt or the reply so far
    logits[t] *= r  otherwise             (the repetition penalty r: vLLM's, transformers')
    logits[t] -= frequency_penalty * count(t) + presence_penalty * (count(t) > 0)   (OpenAI's)

where count(t) is how often token t occurs in the request's reply so far (OpenAI's and vLLM's
rule: the prompt is not counted). The repetition penalty reads the prompt's tokens from a mask
built once per request (`prompt_token_mask`), and the reply's from the step. `min_tokens` never
leaves a row with no token at all: where only stop tokens are finite (a grammar that can only
end), they stay. Rows with neutral settings are left alone, and a step with none costs one pass
over its params.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from radixkv.cache import PackedTokens
from radixkv.engine.sampling.sampler import host_values_on
from radixkv.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class RowTokens:
    """What a row's adjustments read of its request's tokens."""

    output: Sequence[int]  # the tokens it has generated, known on the host
    # [1] int64: its last generated token, still on the device (an overlapped step's, not read
    # yet); None when every token is known
    in_flight: torch.Tensor | None = None
    # [vocab] bool: its prompt's tokens (`prompt_token_mask`); needed with a repetition penalty
    prompt_mask: torch.Tensor | None = None
    stop_token_ids: Collection[int] = ()  # what min_tokens holds back (EOS included)

    @property
    def num_generated(self) -> int:
        return len(self.output) + (0 if self.in_flight is None else len(self.in_flight))


def prompt_token_mask(prompt: PackedTokens, vocab: int, device: torch.device) -> torch.Tensor:
    """[vocab] bool on `device`, True at each token id of `prompt` (ids < vocab): the request
    state its repetition penalty reads every step, built once."""
    ids = np.unique(np.frombuffer(prompt.tobytes(), dtype=np.uint32)).astype(np.int64)
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[torch.from_numpy(ids[ids < vocab])] = True
    return mask.to(device)


def adjust_logits(
    logits: torch.Tensor, params: Sequence[SamplingParams], rows: Sequence[RowTokens]
) -> torch.Tensor:
    """`logits` ([num_rows, vocab]) with each row's adjustments applied; `rows[i]`: row i's
    request's tokens. The same tensor when no row asks for any. Nothing here waits for the
    device."""
    active = [
        i for i, (p, r) in enumerate(zip(params, rows, strict=True))
        if p.adjusts_logits_at(r.num_generated)
    ]  # fmt: skip
    if not active:
        return logits
    logits = logits.clone()  # the model's own logits stay as they are (logprobs read them)
    for i in active:
        _adjust_row(logits[i], params[i], rows[i])
    return logits


def _adjust_row(row: torch.Tensor, p: SamplingParams, tokens: RowTokens) -> None:
    """One row's adjustments, in place. row: [vocab], a view of the step's logits."""
    device, vocab = row.device, row.shape[0]
    if tokens.num_generated < p.min_tokens:
        _hold_back(row, [t for t in sorted(tokens.stop_token_ids) if t < vocab])
    if p.logit_bias:
        ids = host_values_on(device, [t for t, _ in p.logit_bias], torch.int64)
        row[ids] += host_values_on(device, [b for _, b in p.logit_bias], row.dtype)
    penalised = p.repetition_penalty != 1.0
    if not (penalised or p.presence_penalty or p.frequency_penalty):
        return
    counts = _token_counts(tokens.output, tokens.in_flight, vocab, device)
    if penalised:
        assert tokens.prompt_mask is not None, "a repetition penalty needs its prompt's mask"
        seen = tokens.prompt_mask if counts is None else tokens.prompt_mask | (counts > 0)
        r = p.repetition_penalty
        row.copy_(torch.where(seen, torch.where(row > 0, row / r, row * r), row))
    if counts is not None and (p.presence_penalty or p.frequency_penalty):
        counts = counts.to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def _hold_back(row: torch.Tensor, stop_ids: list[int]) -> None:
    """The stop tokens to -inf, unless no other token is finite. stop_ids: distinct, < vocab."""
    if not stop_ids:
        return
    ids = host_values_on(row.device, stop_ids, torch.int64)
    stops = row[ids]
    others_left = torch.isfinite(row).sum() > torch.isfinite(stops).sum()
    row[ids] = torch.where(others_left, float("-inf"), stops)


def _token_counts(
    generated: Sequence[int], on_device: torch.Tensor | None, vocab: int, device: torch.device
) -> torch.Tensor | None:
    """How often each token id occurs in `generated` and `on_device` together ([vocab], float32:
    exact for any count a reply reaches), or None when both are empty. `index_add_`, not
    `bincount`: bincount reads its input's maximum back to the host."""
    parts = [host_values_on(device, generated, torch.int64)] if generated else []
    if on_device is not None:
        parts.append(on_device.long())
    if not parts:
        return None
    ids = torch.cat(parts) if len(parts) > 1 else parts[0]
    counts = torch.zeros(vocab, dtype=torch.float32, device=device)
    return counts.index_add_(0, ids, torch.ones(ids.shape, dtype=torch.float32, device=device))
