"""What one scheduler step hands the model runner: the interface between scheduler and runner.

Token regions of a scheduled row (B = block size):

    positions  0 ............ start_position ........ start_position + len(token_ids)
               |  KV already written (cached    |  new tokens this step:      |
               |  prefix + earlier chunks)      |  KV written, then attended |
    each of its block tables covers ceil((start_position + len(token_ids)) / B) blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixkv.cache.moves import Move


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy-on-write of a partially matched block, done before the forward of the step."""

    src_block: int  # shared block owned by the tree (locked by the request, so it stays valid)
    dst_block: int  # the request's fresh private block
    num_slots: int  # valid leading slots to copy (match length % block size)


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One row of the packed step: a prefill chunk or a single decode token."""

    request_id: str
    token_ids: tuple[int, ...]  # tokens whose KV is computed this step
    start_position: int  # absolute position of token_ids[0]
    # Per KV cache group (`radixkv.cache.grouped`, in group order), the physical blocks for
    # positions [0, start_position + len(token_ids)): 0 where a group let go of a block that no
    # query of the row reads
    block_tables: tuple[tuple[int, ...], ...]
    # True when the logits of the last token are sampled (final prefill chunk / decode)
    sample: bool


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """What one KV cache group's blocks need before the step's forward: its tier moves
    (`radixkv.cache.moves`), planned since the last step, in order, then its copies."""

    copies: tuple[BlockCopy, ...] = ()  # copy-on-write of partially matched blocks
    moves: tuple[Move, ...] = ()


NO_PLAN = GroupPlan()


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    rows: tuple[ScheduledRequest, ...]  # in packing order
    # per KV cache group, in group order: moves and copies to run before the forward (a group
    # past the end of the tuple has none)
    plans: tuple[GroupPlan, ...] = ()
    preempted_ids: tuple[str, ...] = ()  # requests moved back to waiting this step
    finished_ids: tuple[str, ...] = ()  # requests finished by abort/rejection

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rows)

    @property
    def is_empty(self) -> bool:
        return not self.rows

    @property
    def has_moves(self) -> bool:
        return any(plan.moves for plan in self.plans)

    def plan(self, group: int) -> GroupPlan:
        """Group `group`'s plan (an empty one past the end of `plans`)."""
        return self.plans[group] if group < len(self.plans) else NO_PLAN
