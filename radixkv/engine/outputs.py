"""What the engine hands back: finished requests and stream deltas."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from radixkv.cache import hit_rate


@dataclass(frozen=True, slots=True)
class RequestStats:
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served by the prefix cache (at first admission)
    num_output_tokens: int
    ttft_s: float  # submission -> first token sampled
    decode_tokens_per_s: float  # tokens after the first / time after the first (0 if only one)
    total_s: float  # submission -> finished
    # What the tree matched at that admission: more than num_cached_tokens when a window
    # model's hit was cut back to where its window layers' KV was kept
    num_matched_tokens: int

    @property
    def cache_hit_rate(self) -> float:
        return hit_rate(self.num_cached_tokens, self.num_prompt_tokens)

    @property
    def hit_cut_reason(self) -> str | None:
        """Why the tree matched more of the prompt than the cache served (None: it did not)."""
        return hit_cut_reason(self.num_cached_tokens, self.num_matched_tokens)


def hit_cut_reason(num_cached_tokens: int, num_matched_tokens: int) -> str | None:
    """The words for a hit cut back (None when it was not), where the user reads hits."""
    if num_matched_tokens <= num_cached_tokens:
        return None
    return (
        f"the tree matched {num_matched_tokens} tokens, but this model's sliding-window or "
        f"recurrent layers kept what a hit resumes from only up to {num_cached_tokens}: a hit "
        "resumes only where they did"
    )


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A generated token's log-probability and its most likely alternatives (`logprobs.py`)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]  # generated tokens, including a final EOS / stop token if any
    text: str  # detokenised reply without special tokens ("" when the model has no tokenizer)
    # "stop" (EOS or a stop token), "length" (max_tokens / model length), "abort", "error" (its
    # step failed)
    finish_reason: str
    stats: RequestStats
    # one per generated token when the request's params asked for logprobs, else None
    logprobs: tuple[TokenLogprobs, ...] | None = None


@dataclass(frozen=True, slots=True)
class StreamDelta:
    """One step of `LLM.stream`: new text (possibly empty while a multi-byte character is
    incomplete), new tokens, and their logprobs when the params asked for them (one per token,
    else empty). The last delta carries the finished RequestOutput."""

    text: str
    token_ids: tuple[int, ...]
    output: RequestOutput | None = None  # set on the final delta only
    logprobs: tuple[TokenLogprobs, ...] = ()

    @property
    def finished(self) -> bool:
        return self.output is not None


class DeltaStream(Iterator[StreamDelta]):
    """What `LLM.stream` returns: the deltas, and `on_close` (abort the request, drop its record)
    run once when it is closed, exhausted, fails, or is dropped, started or not; a bare
    generator's `finally` never runs unless it was started."""

    def __init__(self, deltas: Iterator[StreamDelta], on_close: Callable[[], None]) -> None:
        self._deltas = deltas
        self._on_close: Callable[[], None] | None = on_close

    def __next__(self) -> StreamDelta:
        try:
            return next(self._deltas)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    def __del__(self) -> None:
        self.close()
