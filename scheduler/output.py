"""What one scheduler step hands the model runner: the interface between scheduler and runner.

Token regions of a scheduled row (B = block size):

    positions  0 ............ start_position ........ start_position + len(token_ids)
               |  KV already written (cached    |  new tokens this step:      |
               |  prefix + earlier chunks)      |  KV written, then attended |
    block_table covers ceil((start_position + len(token_ids)) / B) blocks.
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
    # physical blocks for positions [0, start_position + len(token_ids))
    block_table: tuple[int, ...]
    # True when the logits of the last token are sampled (final prefill chunk / decode)
    sample: bool
    # A model with window layers: their blocks for the same positions (0 where a block that no
    # query of the row reads was released); () otherwise
    window_block_table: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    rows: tuple[ScheduledRequest, ...]  # in packing order
    copies: tuple[BlockCopy, ...] = ()  # block copies to perform before the forward
    preempted_ids: tuple[str, ...] = ()  # requests moved back to waiting this step
    finished_ids: tuple[str, ...] = ()  # requests finished by abort/rejection
    # tier moves (`radixkv.cache.moves`) the cache planned since the last step, in order: run
    # before the copies and the forward
    moves: tuple[Move, ...] = ()
    # copy-on-write of partial window-layer blocks (a model with window layers), with `copies`
    window_copies: tuple[BlockCopy, ...] = ()
    # the window group's tier moves, over the window layers' blocks, run with `moves`
    window_moves: tuple[Move, ...] = ()

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rows)

    @property
    def is_empty(self) -> bool:
        return not self.rows
