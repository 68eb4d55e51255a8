"""The cache's planned tier moves, run group by group, and what a failed one means for a step.

Each KV cache group's moves run over its own tensors, by its own mover (`TierIO`), in the order
the cache planned them, before the copies and forward of the step whose output carries them
(`SchedulerOutput.plans`). A move that fails leaves blocks holding garbage: the cache forgets the
host copies among them at once, and the step learns which of its requests read a garbage device
block (`MoveFailure`): the engine sends those back to the waiting queue, to be admitted from what
the cache holds then, and fails one whose copy failed a second time. A block file that could not
be read is a miss, not a fault: the disk tier does not offer it again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from radixkv.cache.grouped import GroupedCache
from radixkv.cache.moves import Move, Poisoned
from radixkv.engine.tiers.tier_io import TierIO
from radixkv.scheduler.output import SchedulerOutput


@dataclass(frozen=True, slots=True)
class MoveFailure:
    """The requests of a step whose rows read device blocks that a failed move left holding
    garbage (their rows still run, and are ignored)."""

    reading: tuple[str, ...]  # every such request
    struck: tuple[str, ...]  # of them, those a fault struck (not only a missed block file)


def run_group_moves(
    tier_ios: Sequence[TierIO | None], cache: GroupedCache, group: int, moves: Sequence[Move]
) -> Poisoned:
    """Run group `group`'s moves in order; the cache forgets the host copies a failed move left
    holding garbage, whatever happens. Returns the blocks that failed."""
    tier_io = tier_ios[group]
    assert tier_io is not None, "the cache plans moves only with a host tier"
    try:
        poisoned = tier_io.run(moves)
    finally:
        cache.forget(group, sorted(tier_io.poisoned_so_far.host))
    tier_io.order_before_compute()
    return poisoned


def run_step_moves(
    out: SchedulerOutput, tier_ios: Sequence[TierIO | None], cache: GroupedCache
) -> MoveFailure | None:
    """The step's moves, every group's, before its copies and forward; None when all worked."""
    poisoned = [
        run_group_moves(tier_ios, cache, g, plan.moves) if plan.moves else Poisoned()
        for g, plan in enumerate(out.plans)
    ]
    if not any(p.device for p in poisoned):
        return None

    def reading(bad: list[set[int]]) -> tuple[str, ...]:
        return tuple(
            row.request_id
            for row in out.rows
            if any(b.intersection(t) for b, t in zip(bad, row.block_tables, strict=False))
        )

    return MoveFailure(reading([p.device for p in poisoned]), reading([p.faulty for p in poisoned]))


def run_planned_moves(tier_ios: Sequence[TierIO | None], cache: GroupedCache) -> None:
    """Every group's moves planned since the last step (e.g. by `persist`), in order."""
    for group, moves in enumerate(cache.take_moves()):
        if moves:
            run_group_moves(tier_ios, cache, group, moves)
