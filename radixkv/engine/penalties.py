"""The logit adjustments a request may ask for, with OpenAI's meaning, applied to a step's logits
before sampling (greedy rows included):

    logits[t] += logit_bias[t]
    logits[t] -= frequency_penalty * count(t) + presence_penalty * (count(t) > 0)

where count(t) is how often token t occurs in the request's reply so far (OpenAI's and vLLM's
rule: the prompt is not counted). Rows with neutral settings are left alone, and a step with
none costs one pass over its params.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixkv.engine.sampler import host_values_on
from radixkv.engine.sampling_params import SamplingParams


def adjust_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    outputs: Sequence[Sequence[int]],
    in_flight: Sequence[torch.Tensor | None] = (),
) -> torch.Tensor:
    """`logits` ([num_rows, vocab]) with each row's bias and penalties applied; `outputs[i]`:
    the tokens row i's request has generated, and `in_flight[i]` (if given and not None) its
    generated tokens still on the device (an overlapped step's, not read yet). The same tensor
    when no row asks for any. Nothing here waits for the device."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    logits = logits.clone()  # the model's own logits stay as they are (logprobs read them)
    device, vocab = logits.device, logits.shape[1]
    for i in rows:
        p = params[i]
        if p.logit_bias:
            ids = host_values_on(device, [t for t, _ in p.logit_bias], torch.int64)
            bias = host_values_on(device, [b for _, b in p.logit_bias], logits.dtype)
            logits[i, ids] += bias
        if p.presence_penalty or p.frequency_penalty:
            counts = _token_counts(outputs[i], in_flight[i] if in_flight else None, vocab, device)
            if counts is not None:
                counts = counts.to(logits.dtype)
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return logits


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
