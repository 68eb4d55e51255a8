"""The step loop of the server's engine: one owner of the `LLM`, wherever it runs.

    commands (closures) ──► inbox ──► EngineWorker.run: run them between steps, then llm.step()
                                          │
                                          ├─► deliver(updates)  one batch per step
                                          └─► publish(snapshot) after commands (a call: before its
                                              answer) and after steps

The same loop runs on a thread of the server's process (`engine_loop.EngineLoop`) and in an
engine process of its own (`engine_process`); only how commands arrive and results leave differs,
and that is the caller's: the worker calls the three callbacks it was given, on its own thread.
`LLM` is not thread-safe: only the worker's thread touches it.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from radixkv.cache import CacheStats
from radixkv.cache.state import StateStats
from radixkv.engine.llm import LLM, RequestUpdate
from radixkv.engine.sampling_params import SamplingParams
from radixkv.serve.engine_snapshot import EngineSnapshot

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineWorker:
    """Steps `llm` for a front end. `put` may be called from any thread; `run` (the loop) and
    every command run on one thread, which also calls `deliver`, `publish` and `fail_all`:
    `deliver(updates)` after a step that had any, `publish(snapshot)` after commands and after
    each step, `fail_all(exc)` when a step broke its promise to fail only its own requests."""

    def __init__(
        self,
        llm: LLM,
        *,
        deliver: Callable[[list[RequestUpdate]], None],
        publish: Callable[[EngineSnapshot], None],
        fail_all: Callable[[BaseException], None],
    ) -> None:
        self.llm = llm
        self._deliver, self._publish, self._fail_all = deliver, publish, fail_all
        self._inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._stopping = False
        self._must_step = False  # an abort was made: its final update comes with a step

    # ------------------------------------------------------------------ any thread

    def put(self, command: Callable[[], None]) -> None:
        """Run `command()` on the worker's thread between two steps."""
        self._inbox.put(command)

    def stop(self) -> None:
        """Ask `run` to return after the step in flight."""
        self._stopping = True
        self._inbox.put(None)

    @property
    def num_inbox(self) -> int:
        return self._inbox.qsize()

    # ------------------------------------------------------------------ the worker's thread

    def add(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str | None,
        grammar: Any | None,
    ) -> str:
        """Queue a request (what `llm.add_request` raises, nothing queued); its id."""
        return self.llm.add_request(
            list(prompt_token_ids), params, cache_salt=cache_salt, grammar=grammar
        )

    def abort(self, request_id: str) -> None:
        if self.llm.abort_request(request_id):
            self._must_step = True

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(llm, *args)`; what it changed (a flush's freed blocks) is published before its
        caller hears back, so a `/metrics` read after the answer shows it."""
        try:
            return fn(self.llm, *args)
        finally:
            self._publish(self.snapshot())

    def snapshot(self) -> EngineSnapshot:
        """The engine's current counters."""
        llm, scheduler = self.llm, self.llm.scheduler
        stats = llm.cache.stats()
        state = next((s for s in llm.cache.group_stats() if isinstance(s, StateStats)), None)
        return EngineSnapshot(
            num_waiting=llm.num_waiting_requests,
            num_running=scheduler.num_running,
            num_free_blocks=stats.num_free_blocks,
            num_evictable_blocks=stats.num_evictable_blocks,
            num_in_use_blocks=stats.num_in_use_blocks,
            num_evicted_blocks=stats.num_evicted_blocks,
            num_preemptions=scheduler.num_preemptions,
            hit_tokens_by_tier=_hit_tokens_by_tier(stats),
            tier_moves=tier_moves(*llm.tier_ios),
            **({} if state is None else _snapshot_figures(state)),
        )

    def run(self) -> None:
        """Take commands and step until `stop`."""
        self._publish(self.snapshot())  # /metrics shows the real pool before any request
        while not self._stopping:
            busy = self.llm.has_unfinished_requests() or self._must_step
            try:
                # Idle: sleep until a command arrives. Busy: take what is there, then step.
                command = self._inbox.get(block=not busy)
            except queue.Empty:
                command = None
            else:
                if command is None:
                    continue  # stop() woke us up
                command()
                self._drain_inbox()
                # Requests taken from the inbox now count as waiting in the engine, before the
                # step: the queue limit never loses sight of them.
                self._publish(self.snapshot())
            if not (self.llm.has_unfinished_requests() or self._must_step):
                continue
            self._must_step = False
            try:
                updates = self.llm.step()
            except Exception as exc:
                # step() fails the requests of a faulty step itself; this is a bug in that
                # promise: fail every live request rather than leave its client hanging.
                logger.exception("engine step raised")
                self._fail_all(exc)
                continue
            self._publish(self.snapshot())
            if updates:
                self._deliver(updates)

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command is None:
                return
            command()


def tier_moves(*tier_ios: Any) -> dict[str, tuple[int, float]]:
    """Bytes and seconds of each kind of move since start, summed over the movers given (one per
    cache group, a hybrid model's snapshots' included; the live page shows the other groups'
    apart)."""
    moves: dict[str, tuple[int, float]] = {}
    for tier_io in tier_ios:
        for kind, t in ({} if tier_io is None else tier_io.totals).items():
            nbytes, seconds = moves.get(kind, (0, 0.0))
            moves[kind] = (nbytes + t.nbytes, seconds + t.seconds)
    return moves


def _snapshot_figures(state: StateStats) -> dict[str, int]:
    """The state group's figures as `EngineSnapshot` names them."""
    return {
        "num_snapshots": state.num_snapshots,
        "num_snapshot_bytes": state.num_snapshot_bytes,
        "num_snapshot_hits": state.num_hits,
        "num_snapshot_hit_tokens": state.num_hit_tokens,
    }


def _hit_tokens_by_tier(stats: CacheStats) -> dict[str, int]:
    """Prompt tokens served from each tier since start (the device: the tree's own hits)."""
    lower = stats.num_host_hit_tokens + stats.num_disk_hit_tokens
    return {
        "device": stats.num_hit_tokens - lower,
        "host": stats.num_host_hit_tokens,
        "disk": stats.num_disk_hit_tokens,
    }
