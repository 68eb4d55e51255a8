"""One generation request: its tokens, how far its KV is written, and the blocks it uses.

Token regions of a request (B = block size):

    0 ........... num_computed_tokens ............. len(all_token_ids)
    | KV written (cached prefix +  |  still to compute: the rest of the     |
    | computed chunks / decodes)   |  prompt, or the last sampled token     |

While running, at least one token is still to compute (the last sampled token has no KV yet), so
`num_computed_tokens < len(all_token_ids)`; the next row computes from `num_computed_tokens` on.
The scheduler owns the block bookkeeping fields; everything else is read-only to callers.

With overlapped steps (`radixkv.engine.step.launch`), a step's sampled tokens are read one step
late: the scheduler appends a placeholder for each sampled row when the step is launched, and the
next step computes it (the device feeds it the real token); `fill_placeholder` writes the real token
in, oldest first, and ends generation there if it stops. `num_pending` counts the placeholders,
always the last output tokens.
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Iterable, Sequence

from radixkv.cache.grouped import GroupedTable
from radixkv.cache.tokens import PackedTokens

PLACEHOLDER = 0  # the value of an output token not yet read back (any valid token id would do)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"  # a stop token (or EOS) was sampled
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

    Built by the engine from input it has validated: a prompt of 1 to max_model_len - 1 token ids
    (a `PackedTokens` is taken as is; a list, as tests pass, is packed), `max_tokens` >= 1, and
    `stop_token_ids`, every token that ends generation (the engine adds the model's EOS ids to the
    request's own stop tokens unless it ignores EOS). Nothing is checked again here.

    `all_token_ids` (prompt + output) is an `array('I')` that sampled tokens are appended to in
    amortized O(1); `packed_tokens` is the same tokens as the cache reads them without a copy.

    Invariants while RUNNING (checked by `Scheduler.check_integrity`):
    * `num_computed_tokens < len(all_token_ids)` and `table` (the cache's `GroupedTable`) covers at
      least `ceil(num_computed_tokens / B)` blocks.
    While WAITING and once finished: no table, and `num_computed_tokens == 0` while waiting; the
    token fields keep their final values.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        stop_token_ids: Iterable[int] = (),
        *,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = PackedTokens(prompt_token_ids)  # no copy of a PackedTokens
        self.max_tokens = max_tokens  # new tokens to generate at most
        self.stop_token_ids = frozenset(stop_token_ids)
        # The cache namespace: requests share cached KV only with requests of the same salt.
        self.cache_salt = cache_salt

        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" once finished
        self.output_token_ids: list[int] = []
        self.num_pending = 0  # placeholders at the end of the output, their tokens not yet read
        # Once it has a placeholder, not computed further until that is read: the engine looks
        # at its tokens between steps (jump-forward, `Scheduler.hold`); cleared by that fill.
        self.held = False
        self.all_token_ids = array("I", self.prompt_token_ids.tobytes())  # prompt + output
        self._packed = self.prompt_token_ids  # all_token_ids when it was last packed
        self.num_computed_tokens = 0  # tokens whose KV is written (this admission)
        self.num_cached_tokens = 0  # cache hit at the first admission
        self.num_matched_tokens = 0  # what the tree matched then (more: the hit was cut back)
        self.num_preemptions = 0
        self.num_prefill_tokens = 0  # len(all_token_ids) at the latest admission
        self.table: GroupedTable | None = None  # its blocks and lock while RUNNING

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def packed_tokens(self) -> PackedTokens:
        """`all_token_ids` as a PackedTokens, repacked only when tokens were appended since it was
        last read (tokens are only ever appended: an equal length means equal tokens). A waiting
        request, scored by the policy every step, is packed once."""
        if len(self._packed) != len(self.all_token_ids):
            self._packed = PackedTokens.frombytes(self.all_token_ids.tobytes())
        return self._packed

    @property
    def num_tokens_to_compute(self) -> int:
        return len(self.all_token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def max_num_tokens(self, max_model_len: int) -> int:
        """Longest `all_token_ids` can become: generation stops at max_tokens or max_model_len."""
        return min(self.num_prompt_tokens + self.max_tokens, max_model_len)

    def append_output_token(self, token_id: int, max_model_len: int) -> None:
        """Record a sampled token and finish the request if it stops generation."""
        self.append_placeholder()
        self.fill_placeholder(token_id, max_model_len)

    def append_placeholder(self) -> None:
        """One more output token whose value comes later (`fill_placeholder`)."""
        assert self.status is RequestStatus.RUNNING, f"{self}: append while not running"
        self.output_token_ids.append(PLACEHOLDER)
        self.all_token_ids.append(PLACEHOLDER)
        self.num_pending += 1

    def fill_placeholder(self, token_id: int, max_model_len: int) -> None:
        """The oldest placeholder's token; if it stops generation the request finishes and any
        later placeholder is dropped (the step that computed it is wasted). It may be waiting
        (preempted since its step was launched): a token does not depend on that."""
        assert self.num_pending > 0 and not self.is_finished, f"{self}: nothing to fill"
        index = len(self.output_token_ids) - self.num_pending
        end = self.num_prompt_tokens + index + 1  # tokens through this one
        self.output_token_ids[index] = token_id
        self.all_token_ids[end - 1] = token_id
        self.num_pending -= 1
        if len(self._packed) >= end:  # packed with the placeholder in it: repack when read
            self._packed = self.prompt_token_ids
        if token_id in self.stop_token_ids:
            del self.output_token_ids[index + 1 :], self.all_token_ids[end:]
            self.num_pending = 0
            self.set_finished(RequestStatus.FINISHED_STOPPED)
        elif end >= self.max_num_tokens(max_model_len):
            assert self.num_pending == 0, f"{self}: a placeholder past the length limit"
            self.set_finished(RequestStatus.FINISHED_LENGTH)
        self.held = self.held and self.num_pending > 0

    def jump(self, num_kept: int, token_ids: Sequence[int], max_model_len: int) -> int:
        """Keep the first `num_kept` output tokens and append `token_ids` after them (jump-forward:
        text a grammar forces), cut at the length limit, which finishes the request. Only tokens
        without KV are replaced, and none is a stop token (the engine's checks). Returns how many
        of `token_ids` were appended."""
        end = self.num_prompt_tokens + num_kept  # tokens kept
        assert not self.num_pending and not self.is_finished, f"{self}: jump with tokens unread"
        assert self.num_computed_tokens <= end <= self.num_tokens, (self, num_kept)
        assert token_ids and not self.stop_token_ids.intersection(token_ids), token_ids
        appended = list(token_ids[: self.max_num_tokens(max_model_len) - end])
        del self.output_token_ids[num_kept:], self.all_token_ids[end:]
        self.output_token_ids += appended
        self.all_token_ids.extend(appended)
        if len(self._packed) > end:  # packed with a replaced token in it: repack when read
            self._packed = self.prompt_token_ids
        if self.num_tokens >= self.max_num_tokens(max_model_len):
            self.set_finished(RequestStatus.FINISHED_LENGTH)
        return len(appended)

    def set_finished(self, status: RequestStatus) -> None:
        assert status.is_finished, status
        if self.num_pending:  # aborted or failed with tokens in flight: never read now
            del self.output_token_ids[-self.num_pending :], self.all_token_ids[-self.num_pending :]
            self.num_pending = 0
        self.status = status
        self.finish_reason = _FINISH_REASONS[status]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"output={len(self.output_token_ids)}, computed={self.num_computed_tokens})"
        )
