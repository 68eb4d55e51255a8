"""Log-probabilities of sampled tokens, OpenAI's `logprobs` / `top_logprobs`.

They are of the model's own distribution (a log-softmax of its logits), before min_tokens,
logit bias, penalties (the repetition penalty included), temperature and min-p / top-k / top-p:
what the model thought of each token, as vLLM reports by default. Computed only for the rows
that ask for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixkv.engine.outputs import TokenLogprobs
from radixkv.engine.sampling.sampler import host_values_on
from radixkv.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class StepLogprobs:
    """The logprobs of the rows of one step that asked for them, as tensors (on the device, or
    copied to the host by `to_host`); `read` turns them into TokenLogprobs."""

    rows: list[int]  # the rows, in order
    chosen: torch.Tensor  # [len(rows)] the sampled token's logprob
    top_values: torch.Tensor  # [len(rows), k] the top k logprobs, k = the rows' largest request
    top_ids: torch.Tensor  # [len(rows), k] their token ids

    def to_host(self) -> StepLogprobs:
        """Copies in pinned host memory, queued behind the step's work: valid once the device
        got there (the overlapped step's `ready` event). On a CPU, itself."""
        if self.chosen.device.type != "cuda":
            return self

        def pinned(t: torch.Tensor) -> torch.Tensor:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return host.copy_(t, non_blocking=True)

        return StepLogprobs(
            self.rows, pinned(self.chosen), pinned(self.top_values), pinned(self.top_ids)
        )

    def read(
        self, params: Sequence[SamplingParams], tokens: Sequence[int | Exception]
    ) -> list[TokenLogprobs | None]:
        """Per row of the step: its TokenLogprobs, None for a row that asked for none."""
        result: list[TokenLogprobs | None] = [None] * len(params)
        chosen, values, ids = self.chosen.tolist(), self.top_values.tolist(), self.top_ids.tolist()
        for j, i in enumerate(self.rows):
            n = params[i].logprobs or 0
            top = tuple(zip(ids[j][:n], values[j][:n], strict=True))
            result[i] = TokenLogprobs(int(tokens[i]), chosen[j], top)  # type: ignore[arg-type]
        return result


def logprobs_on_device(
    logits: torch.Tensor, params: Sequence[SamplingParams], rows: list[int], tokens: torch.Tensor
) -> StepLogprobs:
    """The logprobs of `rows` of `logits` ([num_rows, vocab]) whose sampled tokens are `tokens`
    ([len(rows)], on the logits' device). Nothing here waits for the device."""
    index = host_values_on(logits.device, rows, torch.int64)
    logprobs = torch.log_softmax(logits[index].float(), dim=-1)
    chosen = logprobs.gather(1, tokens.long()[:, None])[:, 0]
    k = max(params[i].logprobs or 0 for i in rows)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0])
    return StepLogprobs(rows, chosen, top_values, top_ids.long())
