"""Scheduler settings, validated at construction so a bad value never reaches a step."""

from __future__ import annotations

from dataclasses import dataclass

from radixkv.cache.tokens import check_size
from radixkv.scheduler.policy import POLICIES

# The fields that must be >= 1.
_COUNTS = ("max_num_seqs", "max_num_batched_tokens", "chunked_prefill_size", "max_model_len")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Bounds of one continuous-batching step and the waiting-queue policy.

    Raises TypeError / ValueError on construction for a wrong type or an out-of-range value.
    """

    max_num_seqs: int = 256  # running requests at once (decoding or mid-prefill)
    max_num_batched_tokens: int = 2048  # tokens computed per step, all rows together
    chunked_prefill_size: int = 512  # prefill tokens per request per step
    policy: str = "lpm"  # waiting order: "fcfs" (arrival) | "lpm" (longest cached prefix first)
    # False: no match and no insert; every block is private and freed at finish. Used to check that
    # output with the cache off equals output with it on.
    enable_prefix_cache: bool = True
    max_model_len: int = 8192  # the model's context: prompt + generated tokens of one sequence
    # In-batch prefix caching (SGLang's deprioritise threshold): requests admitted in the same step
    # insert nothing until the step is done, so N requests sharing an uncached prompt prefix would
    # each compute it. A waiting request is held back for this step when a request admitted earlier
    # in the step is computing at least this many tokens of its prefix beyond its own cache hit;
    # next step it finds them cached. Costs the held-back request one step of time to first token,
    # so a short overlap (below the threshold) is recomputed instead. 0 disables; no effect with
    # the prefix cache off.
    defer_shared_prefix_tokens: int = 32
    # Prefill first (SGLang's default order): a step that admits waiting requests runs their
    # prefill and the running requests' prefill chunks, and no decode rows; a step that admits
    # nothing decodes as usual. New requests get their first token a step or more sooner, running
    # ones wait that step. Decodes are never held back for long: every admission adds a running
    # request, so admission stops at `max_num_seqs` or when the pool is full, and then they run.
    prefill_first: bool = False

    def __post_init__(self) -> None:
        for name in _COUNTS:
            check_size(getattr(self, name), name, low=1)
        check_size(self.defer_shared_prefix_tokens, "defer_shared_prefix_tokens", low=0)
        for name in ("enable_prefix_cache", "prefill_first"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        names = tuple(POLICIES)  # a tuple: `in` a dict raises a bare TypeError for a list
        if self.policy not in names:
            raise ValueError(f"policy must be one of {names}, got {self.policy!r}")
