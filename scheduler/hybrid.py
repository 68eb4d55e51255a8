"""The scheduler of a model with sliding-window layers: `Scheduler` over a `HybridCache`.

Everything the base scheduler does holds (admission reserves every full block at once, preemption
by recompute, inserts after each prefill chunk); the window group adds, per request:

    admit     window blocks up to the end of the first chunk, a copy-on-write of the hit's
              partial window block (`SchedulerOutput.window_copies`), or loads of the hit's
              window blocks from the lower tiers (`SchedulerOutput.window_moves`)
    a row     window blocks up to its end (`HybridCache.extend`: per chunk, per decode block;
              out of window blocks preempts, as out of full blocks does), and its window block
              table (`ScheduledRequest.window_block_table`, 0 where a block was released)
    recorded  after the commit (and after a prompt's last chunk a tail one token short of it,
              where the same prompt resumes), `slide`: the window blocks no later query
              reads go back

So a running request holds about W / B + chunk / B window blocks, whatever its length. A model
without window layers runs the base `Scheduler` and none of this.
"""

from __future__ import annotations

from dataclasses import replace

from radixkv.cache.hybrid import HybridCache, HybridTable
from radixkv.scheduler.config import SchedulerConfig
from radixkv.scheduler.output import BlockCopy, ScheduledRequest, SchedulerOutput
from radixkv.scheduler.request import Request
from radixkv.scheduler.scheduler import Scheduler


class HybridScheduler(Scheduler):
    """`Scheduler` for a `HybridCache`: a request's `table` is its `HybridTable`.

    Invariants (`check_integrity`, beside the base's): each running request's window table
    covers its written tokens and lists at most `window_budget(chunk)` blocks.
    """

    cache: HybridCache

    def __init__(self, cache: HybridCache, config: SchedulerConfig) -> None:
        super().__init__(cache, config)  # type: ignore[arg-type]
        self._window_copies: list[BlockCopy] = []  # this step's, in admission order

    def schedule(self) -> SchedulerOutput:
        self._window_copies.clear()  # left by a step that failed inside schedule()
        output = super().schedule()
        moves = tuple(self.cache.take_window_moves())
        if not self._window_copies and not moves:
            return output
        output = replace(output, window_copies=tuple(self._window_copies), window_moves=moves)
        self._window_copies.clear()
        if output.rows:
            self._unrecorded = output
        return output

    def _open_table(self, req: Request, max_hit: int | None, budget: int) -> HybridTable | None:
        chunk = min(self.config.chunked_prefill_size, budget)
        table = self.cache.admit(
            req.packed_tokens, max_hit=max_hit, namespace=req.cache_salt, window_chunk=chunk
        )
        if table is not None and table.window.copy is not None:
            self._window_copies.append(BlockCopy(*table.window.copy))
        return table

    def _reserve(self, req: Request, end: int) -> bool:
        assert req.table is not None
        return self.cache.extend(req.table, end)  # type: ignore[arg-type]

    def _record_row(self, row: ScheduledRequest, req: Request) -> None:
        super()._record_row(row, req)
        # NOTE: one token short of what is written: a request that stops in an overlapped step
        # gives back its last computed token (`fill`), and its final commit keeps the window
        # tail of the tokens before it.
        self.cache.slide(req.table, req.num_computed_tokens - 1)  # type: ignore[arg-type]

    def _insert_written(self, req: Request, *, writes_on: bool) -> None:
        super()._insert_written(req, writes_on=writes_on)
        n = req.num_computed_tokens
        if writes_on and n == req.num_prefill_tokens and n > 1:
            # NOTE: a hit stops one token short of a prompt (its last token is computed), so
            # the same prompt again resumes there, not at the prompt's end.
            self.cache.keep_tail(req.table, req.packed_tokens[: n - 1])  # type: ignore[arg-type]

    def _row(self, req: Request, num_tokens: int) -> ScheduledRequest:
        row = super()._row(req, num_tokens)
        window = req.table.window.blocks[: len(row.block_table)]  # type: ignore[union-attr]
        # Released entries are never read (a window layer reads from its window's start on).
        return replace(row, window_block_table=tuple(b or 0 for b in window))

    def check_integrity(self) -> None:
        super().check_integrity()
        B = self._block_size
        for req in self._running.values():
            window = req.table.window  # type: ignore[union-attr]
            assert len(window.blocks) >= -(-req.num_computed_tokens // B), (req, window)
            chunk, margin = self.config.chunked_prefill_size, self.cache.window.margin
            limit = window_budget(self.cache.window.window, B, chunk, margin)
            assert window.num_live_blocks <= limit, (req, window)


def window_budget(window: int, block_size: int, chunk: int, margin: int = 0) -> int:
    """Window blocks one running request lists at most: those its next chunk's queries read
    (W - 1 tokens before it and the chunk itself, one more where they straddle a block), one
    for the token `_record_row` keeps back, one copy source pinned until its copy ran, and the
    `margin` kept before the window (`radixkv.cache.window.tier_margin`)."""
    return -(-(window + chunk) // block_size) + 2 + margin
