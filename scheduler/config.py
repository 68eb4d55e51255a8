"""What the scheduler reads of its engine's settings: a protocol, so the scheduler needs no engine.

`radixkv.engine.EngineConfig` is the one implementation: it holds every setting of an engine, says
what each means, gives the one set of defaults and validates every value once, at the engine's
door. The scheduler trusts what it is given.
"""

from __future__ import annotations

from typing import Protocol


class SchedulerConfig(Protocol):
    """The bounds of one continuous-batching step and the waiting-queue policy."""

    @property
    def max_num_seqs(self) -> int: ...  # running requests at once
    @property
    def max_num_batched_tokens(self) -> int: ...  # tokens computed per step
    @property
    def chunked_prefill_size(self) -> int: ...  # prefill tokens per request per step
    @property
    def policy(self) -> str: ...  # a key of `radixkv.scheduler.policy.POLICIES`
    @property
    def enable_prefix_cache(self) -> bool: ...
    @property
    def max_model_len(self) -> int | None: ...  # an int once the engine has its model
    @property
    def defer_shared_prefix_tokens(self) -> int: ...
    @property
    def prefill_first(self) -> bool: ...
