"""What the engine publishes of itself after commands and steps: one immutable record."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """Gauges and totals read by `/metrics`, published by the worker after commands and steps."""

    num_waiting: int = 0  # requests queued in the engine, not yet admitted
    num_running: int = 0
    num_free_blocks: int = 0
    num_evictable_blocks: int = 0
    num_in_use_blocks: int = 0
    num_evicted_blocks: int = 0  # totals since start
    num_preemptions: int = 0
    hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)  # device / host / disk
    # per tier move (load, offload, disk_read, disk_write): (bytes, seconds)
    tier_moves: dict[str, tuple[int, float]] = field(default_factory=dict)
    # a hybrid model's recurrent-state snapshots (`radixkv.cache.state`; 0 without any): held,
    # their bytes, and since start the requests that resumed from one and the tokens they skipped
    num_snapshots: int = 0
    num_snapshot_bytes: int = 0
    num_snapshot_hits: int = 0
    num_snapshot_hit_tokens: int = 0
