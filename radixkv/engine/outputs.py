"""What the engine hands back: finished requests and stream deltas."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestStats:
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served by the prefix cache (at first admission)
    num_output_tokens: int
    ttft_s: float  # submission -> first token sampled
    decode_tokens_per_s: float  # tokens after the first / time after the first (0 if only one)
    total_s: float  # submission -> finished

    @property
    def cache_hit_rate(self) -> float:
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0


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


@dataclass(frozen=True, slots=True)
class StreamDelta:
    """One step of `LLM.stream`: new text (possibly empty while a multi-byte character is
    incomplete) and new tokens. The last delta carries the finished RequestOutput."""

    text: str
    token_ids: tuple[int, ...]
    output: RequestOutput | None = None  # set on the final delta only

    @property
    def finished(self) -> bool:
        return self.output is not None
