"""One generation request: its tokens, how far its KV is written, and the blocks it uses.

Token regions of a request (B = block size):

    0 ........... num_computed_tokens ............. len(all_token_ids)
    | KV written (cached prefix +  |  still to compute: the rest of the     |
    | computed chunks / decodes)   |  prompt, or the last sampled token     |

While running, at least one token is still to compute (the last sampled token has no KV yet), so
`num_computed_tokens < len(all_token_ids)`; the next row computes from `num_computed_tokens` on.
The scheduler owns the block bookkeeping fields; everything else is read-only to callers.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from radixkv.cache.prefix_cache import BlockTable
from radixkv.cache.tokens import PackedTokens
from radixkv.scheduler.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"  # a stop token or EOS was sampled
    FINISHED_LENGTH = "finished_length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"  # its step failed (an exception in the engine)

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS


_FINISH_REASONS = {  # the finished statuses and the finish reason each reports
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """A prompt, the tokens generated so far, and the scheduler's bookkeeping for it.

    Tokens are kept as `PackedTokens`: validated once (a caller that hands PackedTokens, as the
    engine does, is not checked again) and read by the cache as they are.

    Invariants while RUNNING (checked by `Scheduler.check_integrity`):
    * `num_computed_tokens < len(all_token_ids)` and `table` (the cache's `BlockTable`) covers at
      least `ceil(num_computed_tokens / B)` blocks.
    While WAITING and once finished: no table, and `num_computed_tokens == 0` while waiting; the
    token fields keep their final values.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        eos_token_ids: Sequence[int] = (),
        *,
        cache_salt: str | None = None,
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")
        for t in eos_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"eos token ids must be ints >= 0, got {t!r}")
        self.request_id = request_id
        self.prompt_token_ids = PackedTokens(prompt_token_ids)  # no copy, no check of PackedTokens
        self.params = params
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        # The cache namespace: requests share cached KV only with requests of the same salt.
        self.cache_salt = cache_salt

        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" once finished
        self.output_token_ids: list[int] = []
        self.all_token_ids: PackedTokens = self.prompt_token_ids  # prompt + output
        self.num_computed_tokens = 0  # tokens whose KV is written (this admission)
        self.num_cached_tokens = 0  # cache hit at the first admission
        self.last_num_cached_tokens = 0  # cache hit at the latest admission (after preemption)
        self.num_preemptions = 0
        self.num_prefill_tokens = 0  # len(all_token_ids) at the latest admission
        self.table: BlockTable | None = None  # its blocks and lock while RUNNING

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        return len(self.all_token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def max_num_tokens(self, max_model_len: int) -> int:
        """Longest `all_token_ids` can become: generation stops at max_tokens or max_model_len."""
        room = max(1, max_model_len - self.num_prompt_tokens)
        return self.num_prompt_tokens + min(self.params.max_tokens, room)

    def append_output_token(self, token_id: int, max_model_len: int) -> None:
        """Record a sampled token and finish the request if it stops generation."""
        assert self.status is RequestStatus.RUNNING, f"{self}: append while not running"
        self.output_token_ids.append(token_id)
        self.all_token_ids += (token_id,)
        p = self.params
        if token_id in p.stop_token_ids or (not p.ignore_eos and token_id in self.eos_token_ids):
            self.set_finished(RequestStatus.FINISHED_STOPPED)
        elif self.num_tokens >= self.max_num_tokens(max_model_len):
            self.set_finished(RequestStatus.FINISHED_LENGTH)

    def set_finished(self, status: RequestStatus) -> None:
        assert status.is_finished, status
        self.status = status
        self.finish_reason = _FINISH_REASONS[status]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"output={len(self.output_token_ids)}, computed={self.num_computed_tokens})"
        )
