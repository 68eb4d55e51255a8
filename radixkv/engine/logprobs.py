"""Log-probabilities of sampled tokens, OpenAI's `logprobs` / `top_logprobs`.

They are of the model's own distribution (a log-softmax of its logits), before logit bias,
penalties, temperature and top-k / top-p: what the model thought of each token, as vLLM reports
by default. Computed only for the rows that ask for them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixkv.engine.outputs import TokenLogprobs
from radixkv.engine.sampling_params import SamplingParams


def token_logprobs(
    logits: torch.Tensor, params: Sequence[SamplingParams], tokens: Sequence[int | Exception]
) -> list[TokenLogprobs | None]:
    """Per row of `logits` ([num_rows, vocab]): the logprobs of its sampled token `tokens[i]`
    and its top alternatives, or None for a row that asked for none (or failed)."""
    rows = [
        i for i, p in enumerate(params) if p.logprobs is not None and isinstance(tokens[i], int)
    ]
    result: list[TokenLogprobs | None] = [None] * len(params)
    if not rows:
        return result
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
    chosen_ids = torch.tensor([tokens[i] for i in rows], device=logits.device)
    chosen = logprobs.gather(1, chosen_ids[:, None])[:, 0].tolist()
    k = max(params[i].logprobs or 0 for i in rows)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0])
    top_values, top_ids = top_values.tolist(), top_ids.long().tolist()
    for j, i in enumerate(rows):
        n = params[i].logprobs or 0
        top = tuple(zip(top_ids[j][:n], top_values[j][:n], strict=True))
        result[i] = TokenLogprobs(int(tokens[i]), chosen[j], top)  # type: ignore[arg-type]
    return result
