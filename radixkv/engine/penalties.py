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

from radixkv.engine.sampling_params import SamplingParams


def adjust_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    outputs: Sequence[Sequence[int]],
) -> torch.Tensor:
    """`logits` ([num_rows, vocab]) with each row's bias and penalties applied; `outputs[i]`:
    the tokens row i's request has generated. The same tensor when no row asks for any."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    logits = logits.clone()  # the model's own logits stay as they are (logprobs read them)
    vocab = logits.shape[1]
    for i in rows:
        p = params[i]
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], device=logits.device)
            bias = torch.tensor([b for _, b in p.logit_bias], dtype=logits.dtype)
            logits[i, ids] += bias.to(logits.device)
        if outputs[i] and (p.presence_penalty or p.frequency_penalty):
            generated = torch.tensor(list(outputs[i]), device=logits.device)
            counts = torch.bincount(generated, minlength=vocab)[:vocab].to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return logits
