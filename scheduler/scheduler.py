"""Continuous batching over the prefix cache: who runs this step, with which tokens and blocks.

Layers: `Request` (tokens, progress) -> its `GroupedTable` (a table per KV cache group: the tree
group's blocks its lock protects + private blocks, and each other group's) -> `GroupedCache`
(`radixkv.cache.grouped`: the radix tree's group and the groups beside it). The scheduler uses the
cache through a small protocol: `admit`, `extend`, `slide`, `commit`, `close` on tables, the
read-only `match` (ordering and deferral), `row_tables` and `take_moves` for the step's output,
`block_size`, `num_blocks`, `stats` and the checks. It never asks which kinds of group there are:
a step's output carries one block table per group in each row and one plan (copies, moves) per
group. A window group, say, frees its blocks as a request's window slides past them, so a
running request holds about W / B + chunk / B of them whatever its length; out of any group's
blocks preempts, as out of the tree's does.

One `schedule()` step, under `max_num_batched_tokens` and `max_num_seqs`:
 1. Decode rows: running requests with one token left to compute, oldest admission first. A token
    that opens a new block gets one; if none can be had even after eviction, the most recently
    admitted running request not yet scheduled this step is preempted by recompute (possibly the
    requester itself), and the allocation is retried.
 2. Prefill rows: running requests mid-prefill continue with their next chunk.
 3. Admission (skipped in a step that preempted): waiting requests in policy order; it stops at the
    first that does not fit, so a large request is delayed, never skipped for ever. A request whose
    prompt prefix a request admitted earlier in the step, or a running request's prefill chunk, is
    computing (in-batch prefix caching, `defer_shared_prefix_tokens`) is deferred to the next step,
    where it finds that prefix cached; a deferral is not a failure to fit, so admission goes on
    with the next request (`_admit`).
With `prefill_first`, step 2 comes first, then 3; a step that admits runs no decode rows, a step
that admits nothing runs step 1 after them.

Admission allocates the blocks for the whole uncached part of the sequence at once, not per chunk:
admission is a reservation, so an admitted prefill never stalls half-way or preempts others for its
own chunks, and preemption is a decode-time event. The price: a long prompt holds all its blocks
from its first chunk on, so fewer requests are admitted under pressure than with per-chunk blocks.

A launched step is recorded in two calls: `record_launched()` when the step is launched advances
each row, inserts the written prefix into the tree after every prefill chunk (concurrent requests
with the same prefix share it at once; the lock moves to the new deepest node) and appends a
placeholder per sampled row; `fill()` brings the sampled tokens and finishes requests (insert
everything written, release the lock, free what is still private). A synchronous step calls them
back to back (`update_from_output()`); overlapped steps (`radixkv.engine.step.launch`) fill one step
later. A request whose placeholder is its last allowed token is not scheduled again, and a request
preempted with a placeholder is not readmitted until it is filled: no row computes past what it
may generate, and nothing unknown reaches the tree.

Jump-forward (the engine's, for text a grammar forces): `jump()` replaces a request's tokens that
have no KV yet (at most its last sampled one) by longer ones, which its next row computes as one
extend, like a prefill chunk; `hold()` keeps a request with a placeholder out of the steps until
that is filled, so that the engine sees all its tokens before it is computed further.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence

from radixkv.cache.grouped import GroupedCache, GroupedTable
from radixkv.cache.tokens import shares_prefix
from radixkv.scheduler.config import SchedulerConfig
from radixkv.scheduler.output import (
    NO_PLAN,
    BlockCopy,
    GroupPlan,
    ScheduledRequest,
    SchedulerOutput,
)
from radixkv.scheduler.policy import POLICIES
from radixkv.scheduler.request import Request, RequestStatus

logger = logging.getLogger(__name__)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    """Continuous-batching scheduler. Deterministic: no wall clock, no randomness.

    Its callers are trusted: the engine validates requests at its door and hands back exactly the
    tokens its rows sampled. Misuse (a live id added again, an output updated twice) is an assert.

    Invariants (recomputed by `check_integrity`):
    * every live request is either in the waiting queue (no block table) or running;
    * at most `max_num_seqs` running; each running request's table covers its written tokens
      and holds what each group allows it (`GroupedCache.check_table`);
    * the scheduler is its cache's only user: the cache's open tables are exactly the running
      requests', so every private block and lock belongs to a running request, and with nothing
      running nothing is in use (no leak).
    """

    def __init__(self, cache: GroupedCache, config: SchedulerConfig) -> None:
        assert config.max_model_len is not None, "the engine sets max_model_len from its model"
        self.cache = cache
        self.config = config
        self._max_len = config.max_model_len
        self._block_size = cache.block_size
        self._use_cache = self.config.enable_prefix_cache
        self._policy = POLICIES[config.policy]()
        # Every live request, by id: waiting in FCFS order (preempted ones put back at the front),
        # running in admission order.
        self._waiting: dict[str, Request] = {}
        self._running: dict[str, Request] = {}
        self._aborted_ids: list[str] = []  # reported in the next output's finished_ids
        self._unrecorded: SchedulerOutput | None = None  # scheduled, not yet record_launched
        self._scheduling = False  # inside schedule(): still set after a fault there
        self.num_preemptions = 0  # since start, every request

    # ------------------------------------------------------------------ queries

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def running_requests(self) -> tuple[Request, ...]:
        """Running requests in admission order (read-only view for runners, displays, tests)."""
        return tuple(self._running.values())

    @property
    def waiting_requests(self) -> tuple[Request, ...]:
        """Waiting requests in FCFS order (the policy may admit them in another order)."""
        return tuple(self._waiting.values())

    def get_request(self, request_id: str) -> Request | None:
        """The live (waiting or running) request with this id, else None."""
        return self._running.get(request_id) or self._waiting.get(request_id)

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        """Queue a new request (a fresh id, a prompt shorter than `max_model_len`: the engine's
        door checked both). ValueError, nothing queued, if it can never run: its tokens' KV would
        need more blocks than the whole cache has."""
        rid, num_prompt, max_len = request.request_id, request.num_prompt_tokens, self._max_len
        assert self.get_request(rid) is None, f"request {rid!r} is already queued or running"
        assert request.status is RequestStatus.WAITING and not request.output_token_ids, request
        assert 0 < num_prompt < max_len, f"{request}: the door lets 1 to {max_len - 1} tokens in"
        # NOTE: the last token of a finished sequence has no KV, hence the - 1.
        max_kv_tokens = request.max_num_tokens(max_len) - 1
        num_blocks = _cdiv(max_kv_tokens, self._block_size)
        if num_blocks > self.cache.num_blocks:
            raise ValueError(
                f"request {rid!r}: prompt of {num_prompt} tokens + up to "
                f"{max_kv_tokens + 1 - num_prompt} generated tokens need {num_blocks} KV blocks of "
                f"{self._block_size} tokens, but the whole cache has {self.cache.num_blocks}"
            )
        self._waiting[rid] = request

    def abort(self, request_id: str) -> bool:
        """Finish a waiting or running request as aborted and free everything it holds (its written
        KV is not inserted). False if no live request has this id (e.g. it just finished)."""
        # Found by where it is, not by its status: after a fault inside a step, a request can be
        # finished but still running, or admitted but still waiting, or half-admitted.
        req = self.get_request(request_id)
        if req is None:
            return False
        self._release(req)  # before it leaves: after a fault here it is still found, and freed
        self._running.pop(request_id, None)
        self._waiting.pop(request_id, None)
        req.set_finished(RequestStatus.FINISHED_ABORTED)
        self._aborted_ids.append(request_id)
        return True

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        """Pick this step's rows; allocate, copy-on-write and preempt as needed.

        Each non-empty output must be passed to `record_launched` before the next call.
        """
        assert self._unrecorded is None, "schedule() called again before record_launched()"
        self._scheduling = True
        budget = self.config.max_num_batched_tokens
        rows: list[ScheduledRequest] = []
        copies: list[list[BlockCopy]] = [[] for _ in self.cache.groups]  # per group
        preempted: list[str] = []
        running = list(self._running.values())  # in admission order

        # Prefill first: the running requests' prefill chunks, then admission, and a step that
        # admits runs no decodes. The chunks go before admission so that a prompt longer than a
        # chunk finishes before newer ones start (as SGLang continues its chunked request first):
        # admitting first gave each step's whole budget to new prompts, and every first token
        # waited until the queue was empty.
        admit_first = self.config.prefill_first and bool(self._waiting)
        if admit_first:
            chunks = [r for r in running if r.num_tokens_to_compute > 1]
            budget = self._schedule_running_rows(chunks, budget, rows, preempted)
            num_chunks = len(rows)
            if not preempted:
                budget = self._admit(budget, rows, copies)
            admitted = len(rows) > num_chunks
            running = [] if admitted else [r for r in running if r.num_tokens_to_compute <= 1]

        # 1. Decodes (and one-token prefill remainders), then 2. prefill chunks of running requests;
        # sorted() is stable, so each kind stays in admission order.
        running.sort(key=lambda r: r.num_tokens_to_compute > 1)
        budget = self._schedule_running_rows(running, budget, rows, preempted)

        # 3. Admission (unless tried first). A step that had to preempt has no blocks to spare,
        # unless it preempted every running request: then nothing else could run and an idle
        # cache admits anything that fits it alone (`_admit`).
        if (not rows) if preempted else (not admit_first):
            budget = self._admit(budget, rows, copies)

        # NOTE: the copies the groups planned since the last step (the state group's snapshots
        # of rows already computed) run before this step's admission copies, which may read
        # or overwrite what they copy. A step without rows runs no copies (the engine launches
        # nothing): they wait for the next step that runs, and nothing writes their sources
        # meanwhile.
        if rows:
            for group_copies, planned in zip(copies, self.cache.take_copies(), strict=True):
                group_copies[:0] = [BlockCopy(*c) for c in planned]
        plans = tuple(
            GroupPlan(tuple(c), tuple(m)) if c or m else NO_PLAN
            for c, m in zip(copies, self.cache.take_moves(), strict=True)
        )
        output = SchedulerOutput(tuple(rows), plans, tuple(preempted), tuple(self._aborted_ids))
        self._aborted_ids.clear()
        if rows:
            self._unrecorded = output
        self._scheduling = False
        return output

    def update_from_output(
        self, output: SchedulerOutput, sampled: Mapping[str, int]
    ) -> list[Request]:
        """A step whose tokens are known when it is recorded: `record_launched`, then `fill`.
        Returns the requests that finished (stop / length) in this step. Rows of requests
        aborted since `schedule()` are ignored (a token sampled for them too)."""
        sample_ids = {r.request_id for r in output.rows if r.sample}
        live_ids = {rid for rid in sample_ids if rid in self._running}
        assert live_ids <= sampled.keys() <= sample_ids, (sampled, sample_ids)
        self.record_launched(output)
        return [req for req in self.fill(output, sampled) if req.is_finished]

    def record_launched(self, output: SchedulerOutput) -> None:
        """Record `output`'s rows as written when the step is launched, before its tokens are
        known; each sampled row appends a placeholder that the next `schedule()` computes (the
        runner feeds it the token on the device). `fill` brings the tokens, at once or one step
        later (overlapped steps)."""
        for row, req in self._live_rows(output):
            self._record_row(row, req)

    def fill(
        self,
        output: SchedulerOutput,
        sampled: Mapping[str, int],
        requeued: Collection[str] = (),
    ) -> list[Request]:
        """The tokens of a `record_launched` step, at once or one step late. Returns the
        requests that took a token, in row order (a request that finished or was aborted since,
        or was `requeue`d before the step was launched, takes none). A request that stops here
        gives back the KV a later step computed for it.
        """
        took: list[Request] = []
        for row in output.rows:
            req = self.get_request(row.request_id) if row.sample else None
            if req is None or row.request_id in requeued:
                continue  # no token to take, or aborted / finished / requeued since
            req.fill_placeholder(sampled[row.request_id], self._max_len)
            took.append(req)
            self._settle(req)
        return took

    def hold(self, request_id: str) -> None:
        """Once a request has a placeholder (now or after its next row), compute nothing more
        of it until that is filled: the engine then sees all its tokens (jump-forward, in
        overlapped steps). A synchronous step fills before the next `schedule()`: no effect."""
        req = self.get_request(request_id)
        assert req is not None and not req.is_finished, request_id
        req.held = True

    def jump(self, request_id: str, num_kept: int, token_ids: Sequence[int]) -> int:
        """Jump-forward: a live request whose tokens are all known keeps its first `num_kept`
        output tokens and takes `token_ids` after them (`Request.jump`: none of the replaced
        tokens has KV), computed by its next rows as one extend; at the length limit it
        finishes here. Returns how many were taken."""
        req = self.get_request(request_id)
        assert req is not None, request_id
        taken = req.jump(num_kept, token_ids, self._max_len)
        self._settle(req)
        return taken

    def _settle(self, req: Request) -> None:
        """Finish a request whose new tokens ended it: free what it holds."""
        if req.is_finished and self._running.get(req.request_id) is req:
            # NOTE: the last token has no KV, as in a step that was not overlapped.
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
            self._finish_running(req)
        elif req.is_finished:  # preempted since its step was launched: holds nothing
            del self._waiting[req.request_id]

    def _live_rows(self, output: SchedulerOutput) -> list[tuple[ScheduledRequest, Request]]:
        """The rows of the last `schedule()`'s output whose requests are still running (rows of
        requests aborted since are dropped); the output is no longer in flight."""
        assert not output.rows or output is self._unrecorded, "not the last schedule()'s output"
        if output.rows:
            self._unrecorded = None
        live = ((row, self._running.get(row.request_id)) for row in output.rows)
        return [(row, req) for row, req in live if req is not None]

    def _record_row(self, row: ScheduledRequest, req: Request) -> None:
        """A row's KV is written, and a placeholder appended for its sampled token. Inserts the
        written prefix after a prefill chunk, then lets the groups slide past what no later
        query reads."""
        assert row.start_position == req.num_computed_tokens, (row, req)
        is_prefill = row.start_position < req.num_prefill_tokens
        req.num_computed_tokens += len(row.token_ids)
        if row.sample:
            req.append_placeholder()
        if self._use_cache and is_prefill:
            self._insert_written(req, writes_on=True)
        # NOTE: one token short of what is written: a request that stops in an overlapped step
        # gives back its last computed token (`fill`), and its final commit keeps what the
        # groups resume from at the tokens before it.
        self.cache.slide(req.table, req.num_computed_tokens - 1)  # type: ignore[arg-type]

    def _finish_running(self, req: Request) -> None:
        """Insert everything a finished request wrote, then free what it holds."""
        if self._use_cache:
            self._insert_written(req, writes_on=False)
        self._release(req)  # while still running: after a fault here, `abort` finds it
        del self._running[req.request_id]

    # ------------------------------------------------------------------ running requests

    def _schedule_running_rows(
        self,
        requests: list[Request],
        budget: int,
        rows: list[ScheduledRequest],
        preempted: list[str],
    ) -> int:
        """Rows for running `requests`, in order, while the budget lasts; returns what is left."""
        for req in requests:
            if budget == 0:
                break
            last = req.num_tokens >= req.max_num_tokens(self._max_len)
            if req.num_pending and (req.held or last):
                continue  # held, or its placeholder is its last token: wait until it is read
            if req.status is RequestStatus.RUNNING:  # not preempted earlier in this step
                n = self._chunk(req, min(req.num_tokens_to_compute, budget))
                row = self._schedule_running(req, n, rows, preempted)
                if row is not None:
                    rows.append(row)
                    budget -= n
        return budget

    def _schedule_running(
        self, req: Request, num_tokens: int, rows: list[ScheduledRequest], preempted: list[str]
    ) -> ScheduledRequest | None:
        """Row for the next `num_tokens` of a running request, preempting others for blocks if
        needed. None if the request itself had to be preempted."""
        assert req.table is not None
        end = req.num_computed_tokens + num_tokens
        while not self._reserve(req, end):
            # The most recently admitted request not yet in this step's batch (`_running` is in
            # admission order); the requester is a candidate itself, so this always finds one.
            in_batch = {row.request_id for row in rows}
            victim = next(
                r for r in reversed(self._running.values()) if r.request_id not in in_batch
            )
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is req:
                return None
        return self._row(req, num_tokens)

    def _reserve(self, req: Request, end: int) -> bool:
        """Every group's blocks for the request's tokens up to `end` (evicting if need be);
        False if they are not there."""
        assert req.table is not None
        return self.cache.extend(req.table, end)

    def _preempt(self, req: Request) -> None:
        """Preempt by recompute: insert what it wrote (so its restart is mostly a cache hit), drop
        its lock and private blocks, put it at the front of the waiting queue."""
        logger.debug("preempting %s", req)
        if self._use_cache:
            self._insert_written(req, writes_on=False)
        self._back_to_waiting(req)
        req.num_preemptions += 1
        self.num_preemptions += 1

    def requeue(self, request_id: str) -> None:
        """Send a request admitted in the step in flight back to the front of the waiting queue,
        inserting nothing it was to read or write (a load into its blocks failed), so that its
        next admission matches what the cache holds then. Its row of that step is ignored."""
        self._back_to_waiting(self._running[request_id])

    def _back_to_waiting(self, req: Request) -> None:
        """Drop a running request's lock and private blocks and put it at the front of the
        waiting queue, to be admitted from scratch."""
        # Released while still running: after a fault in the release, `fail_step` finds it there.
        self._release(req)
        del self._running[req.request_id]
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        self._waiting = {req.request_id: req, **self._waiting}  # O(waiting): this is rare

    def _insert_written(self, req: Request, *, writes_on: bool) -> None:
        """Commit tokens [0, num_computed_tokens) to the tree. `writes_on`: the request goes on
        writing after this (it is neither finishing nor preempted)."""
        n, table = req.num_computed_tokens, req.table
        assert table is not None and n > 0, f"{req}: a running request has a table and wrote KV"
        last = _cdiv(n, self._block_size) - 1
        # (slices: the state group's table lists one slot, not a block per index)
        old_tails = [t.blocks[last : last + 1] for t in table.tables]
        # NOTE: a hit stops one token short of a prompt (its last token is computed): groups
        # that resume only where they kept something keep the point before it too.
        prompt_end = writes_on and n == req.num_prefill_tokens
        self.cache.commit(table, req.packed_tokens[:n], prompt_end=prompt_end)
        # NOTE: a request writes the rest of a partial tail block after inserting it. That is
        # safe only in the block it wrote itself (the tree vouches for the inserted slots alone;
        # another owner's block has later slots of its own), so the cache must hand it back: it
        # keeps a caller's private partial last block, and its own earlier tail, even where the
        # tree already holds those tokens in another block.
        tails = [t.blocks[last : last + 1] for t in table.tables]
        tail_kept = n % self._block_size == 0 or tails == old_tails
        assert tail_kept or not writes_on, f"{req}: insert replaced the tail blocks {old_tails}"

    def _release(self, req: Request) -> None:
        """Unlock and free everything a request holds (after its insert, if any)."""
        if req.table is not None:
            self.cache.close(req.table)
        req.table = None

    # ------------------------------------------------------------------ admission

    def _admit(
        self, budget: int, rows: list[ScheduledRequest], copies: list[list[BlockCopy]]
    ) -> int:
        """Admit waiting requests in policy order; returns the token budget left.

        Stops at the budget, at `max_num_seqs`, or at the first request that does not fit (FCFS
        delays a large request, never skips it). A request deferred by `_defer_for_in_batch_prefix`
        is not a failure to fit: it is passed over this step and admission goes on with the next
        one, so requests that share nothing with this step's batch lose no step. It stays in the
        waiting queue in its position, and it keeps its seat: it counts against `max_num_seqs` for
        the rest of the step, or the requests behind it could fill the running set and hold it back
        until one of them finishes, not one step. Its blocks are not reserved (how many it needs
        depends on next step's hit).

        Deferral and the idle-cache fallback never meet: a request is deferred only behind one
        admitted earlier in the same step or a running one's prefill chunk, so something is running
        and the fallback (for an idle cache) does not apply; a deferred request that later finds
        the cache idle gets the fallback like any other.
        """
        max_seqs = self.config.max_num_seqs
        if not self._waiting or budget == 0 or len(self._running) >= max_seqs:
            return budget  # nothing can be admitted: spare the policy its scoring
        # (request, end): what each request admitted in this step writes, then inserts, this step.
        admitted: list[tuple[Request, int]] = []
        # NOTE: and the prefill chunks of running requests in this step: a prompt longer than a
        # chunk (n choices of a long prompt) would otherwise be computed again by a request
        # admitted beside its second chunk.
        writing = self._prefill_rows(rows)
        num_deferred = 0
        defer = self._use_cache and self.config.defer_shared_prefix_tokens > 0
        waiting = self._waiting.values()
        for req in self._policy.order(waiting, self.cache if self._use_cache else None):
            if budget == 0 or len(self._running) + num_deferred >= max_seqs:
                break
            if req.num_pending:  # preempted in an overlapped step: its tokens are not all known
                continue
            in_batch = writing + admitted
            if defer and in_batch and self._defer_for_in_batch_prefix(req, in_batch):
                num_deferred += 1
                continue
            row = self._try_admit(req, budget, copies, use_hit=True)
            if row is None and not self._running:
                # NOTE: with nothing running nothing is locked, so the request fits without its hit
                # (add_request checked it fits the whole cache). With the hit it may not: its lock
                # pins the whole path it matched, i.e. the copy-on-write source of a partial block
                # and the rest of the node the match ends inside, beside its own blocks. Without
                # the hit nothing is pinned and everything cached can be evicted.
                row = self._try_admit(req, budget, copies, use_hit=False)
                assert row is not None, f"{req} does not fit an idle cache"
            if row is None:
                break
            admitted.append((req, row.start_position + len(row.token_ids)))
            rows.append(row)
            budget -= len(row.token_ids)
        for req, _ in admitted:  # deferred requests keep their place in the queue
            del self._waiting[req.request_id]
        return budget

    def _prefill_rows(self, rows: list[ScheduledRequest]) -> list[tuple[Request, int]]:
        """(request, end) of the rows that compute a running request's prompt this step."""
        live = ((row, self._running.get(row.request_id)) for row in rows)
        return [
            (req, row.start_position + len(row.token_ids))
            for row, req in live
            if req is not None and row.start_position < req.num_prefill_tokens
        ]

    def _defer_for_in_batch_prefix(self, req: Request, in_batch: list[tuple[Request, int]]) -> bool:
        """True if `req` should wait one step for a prefix that requests admitted earlier in this
        step, or running requests' prefill chunks, compute: its longest common prefix with
        `tokens[:end]` of one of them exceeds its own cache hit now by at least
        `defer_shared_prefix_tokens`. Read-only.

        Never starves: a deferral needs a request admitted ahead of this one in the same step, or
        a prefill chunk in it, so a step that defers always computes a prompt, and a deferred
        request is passed only by requests ahead of it in the policy order. What it waited for is
        in the tree after the step (inserted after every prefill chunk; locked while its writer
        runs), so next step its hit
        has grown by at least the threshold and it is not deferred for that prefix again (unless
        its writer was aborted, or finished and the prefix was evicted: then it may compute it).
        """
        tokens = req.packed_tokens
        # NOTE: a hit is capped at len - 1 (the last prompt token is always computed), so only
        # that much of a shared prefix can ever be gained by waiting.
        cap = len(tokens) - 1
        threshold = self.config.defer_shared_prefix_tokens
        peers = [  # only requests of its own namespace can serve it
            (other.packed_tokens, min(end, cap))
            for other, end in in_batch
            if other.cache_salt == req.cache_salt
        ]
        # Waiting gains the threshold only from a peer sharing hit + threshold tokens: a
        # yes-or-no compare per peer (no prefix lengths), and the tree walk only once some peer
        # shares the first `threshold`.
        if not any(shares_prefix(tokens, t, threshold) for t, end in peers if end >= threshold):
            return False
        hit = self.cache.match(tokens, max_tokens=cap, namespace=req.cache_salt).num_cached_tokens
        need = hit + threshold
        if not any(shares_prefix(tokens, t, need) for t, end in peers if end >= need):
            return False
        logger.debug("deferring %s: %d+ prefix tokens computed in this step", req, threshold)
        return True

    def _try_admit(
        self, req: Request, budget: int, copies: list[list[BlockCopy]], *, use_hit: bool
    ) -> ScheduledRequest | None:
        """Match, lock, copy-on-write each group's partial last block, allocate the uncached
        rest (every group's blocks up to the first chunk's end at least); None if the blocks are
        not there, and then the cache is untouched: no query counted, no recency refreshed (the
        fit is checked read-only before anything is locked)."""
        n = req.num_tokens
        # NOTE: the last token is always computed, so there are logits to sample from.
        max_hit = (n - 1 if use_hit else 0) if self._use_cache else None
        chunk = min(self.config.chunked_prefill_size, budget)
        table = self.cache.admit(
            req.packed_tokens, max_hit=max_hit, namespace=req.cache_salt, first_chunk=chunk
        )
        if table is None:
            return None
        req.table = table  # at once: a fault from here on cannot leak its lock or blocks
        for group_copies, t in zip(copies, table.tables, strict=True):
            if t.copy is not None:
                group_copies.append(BlockCopy(*t.copy))
        num_hit = table.num_cached_tokens
        req.num_computed_tokens = num_hit
        if req.num_preemptions == 0:
            req.num_cached_tokens = num_hit
            req.num_matched_tokens = table.num_matched_tokens
        req.num_prefill_tokens = n
        req.status = RequestStatus.RUNNING
        self._running[req.request_id] = req
        return self._row(req, self._chunk(req, min(n - num_hit, budget)))

    def _chunk(self, req: Request, num_tokens: int) -> int:
        """The tokens of a running request's next row: at most `num_tokens` and a prefill
        chunk, ending where a group needs the chunk to end (the state group's snapshot
        points)."""
        assert req.table is not None
        start = req.num_computed_tokens
        end = start + min(num_tokens, self.config.chunked_prefill_size)
        return self.cache.chunk_end(req.table, start, end) - start

    def _row(self, req: Request, num_tokens: int) -> ScheduledRequest:
        """The row computing the request's next `num_tokens` (its table covers them)."""
        start = req.num_computed_tokens
        end = start + num_tokens
        assert req.table is not None
        return ScheduledRequest(
            request_id=req.request_id,
            token_ids=tuple(req.all_token_ids[start:end]),
            start_position=start,
            block_tables=self.cache.row_tables(req.table, _cdiv(end, self._block_size)),
            sample=end == req.num_tokens,
        )

    # ------------------------------------------------------------------ invariants

    def check_integrity(self) -> None:
        """Recompute the scheduler's invariants (see the class docstring), then the cache's."""
        self.cache.check_integrity()
        use_cache, chunk = self._use_cache, self.config.chunked_prefill_size
        assert not self._waiting.keys() & self._running.keys(), "request both waiting and running"
        assert len(self._running) <= self.config.max_num_seqs, "more running than max_num_seqs"
        for rid, req in self._waiting.items():
            assert req.request_id == rid and req.status is RequestStatus.WAITING, req
            assert req.table is None and req.num_computed_tokens == 0, req
        tables: set[GroupedTable] = set()
        for rid, req in self._running.items():
            table = req.table
            assert req.request_id == rid and req.status is RequestStatus.RUNNING, req
            assert table is not None and 0 <= req.num_computed_tokens < req.num_tokens, req
            assert table.locked == use_cache, req
            self.cache.check_table(table, req.num_computed_tokens, req.num_tokens, chunk)
            tables.add(table)
        # NOTE: the scheduler is the only user of its cache: every open table, hence every
        # private block and every lock of the cache, belongs to a running request.
        assert self.cache.open_tables == tables, "the cache's open tables are not the running ones"
        stats = self.cache.stats()
        in_use = stats.num_in_use_blocks
        assert stats.num_locked_tables == (len(self._running) if use_cache else 0), stats
        assert stats.num_private_blocks <= in_use and (self._running or in_use == 0), stats
        if not use_cache:
            assert in_use == stats.num_private_blocks == stats.num_blocks - stats.num_free_blocks

    def fail_step(self) -> list[Request]:
        """After a fault in a step: finish the requests it touched with FINISHED_ERROR and return
        their blocks and locks (their KV of that step is not inserted), so the next `schedule()`
        works. Returns them: the rows of the pending step, [] if none is pending (e.g. the fault
        came after `record_launched()`), and every live request after a fault inside
        `schedule()`, whose partial work no output records."""
        output, self._unrecorded = self._unrecorded, None
        unlaunched = self._scheduling or output is not None  # its copies may not have run
        if self._scheduling:
            self._scheduling = False
            ids = list({**self._running, **self._waiting})
        else:
            ids = [row.request_id for row in output.rows] if output is not None else []
        failed = [req for rid in ids if (req := self.get_request(rid)) is not None]
        for req in failed:
            self.abort(req.request_id)
            req.set_finished(RequestStatus.FINISHED_ERROR)
        if unlaunched:  # after the aborts: none of its requests pins what is dropped
            self.cache.step_failed()
        return failed
