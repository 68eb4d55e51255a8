"""The engine thread: the one owner of the `LLM`, between the HTTP handlers and the step loop.

    HTTP handlers (asyncio)                         engine thread
    submit() / abort() ──► inbox of functions ──►   run them between steps, then llm.step()
    RequestStream queues ◄── call_soon_threadsafe ◄── one batch of RequestUpdates per step

`LLM` is not thread-safe: only the engine thread touches it. The asyncio side never waits on a step;
it awaits futures and queues that the engine thread fills through `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from radixkv.cache import CacheStats
from radixkv.engine.llm import LLM, RequestUpdate
from radixkv.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """Gauges and totals read by `/metrics`, published by the engine thread after each step."""

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


@dataclass(slots=True)
class RequestStream:
    """The asyncio side of one live request: its updates in step order, and timing."""

    request_id: str
    t_arrival: float  # time.perf_counter() when the HTTP request came in
    updates: asyncio.Queue[RequestUpdate | BaseException] = field(default_factory=asyncio.Queue)
    t_first_token: float | None = None
    t_last_token: float | None = None
    finished: bool = False
    cache_salt: str | None = None  # the tenant's, as submitted (None: the shared namespace)


class EngineLoop:
    """Drives `llm.step()` in a background thread for every HTTP request at once.

    Thread rules: `start`, `submit`, `abort`, `release` and `stop` are called from the asyncio
    loop's thread (`call` from any thread); everything that touches the LLM runs on the engine
    thread. `snapshot` is replaced (never mutated) by the engine thread: any thread may read it.
    """

    def __init__(self, llm: LLM, *, on_update: Callable[[RequestStream, RequestUpdate], None]):
        self.llm = llm
        self.snapshot = EngineSnapshot()
        self._on_update = on_update  # asyncio side, per delivered update (metrics)
        self._inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # asyncio side only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._must_step = False  # engine thread: an abort was made; its output comes with a step
        self._ended_with: BaseException | None = None  # asyncio side: set by end_all
        # asyncio side: perf_counter() when the last token of any request was delivered
        self.t_last_token: float | None = None

    # ------------------------------------------------------------------ asyncio side

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the engine thread; updates are delivered on `loop`."""
        if self._thread is not None:
            raise RuntimeError("the engine loop is already running")
        self._loop = loop
        self._publish()  # /metrics shows the real pool before the first request, not zeros
        self._thread = threading.Thread(target=self._run, name="radixkv-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the engine thread to finish its current step and exit; waits up to `timeout`."""
        self._stopping = True
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_queued(self) -> int:
        """Requests not yet admitted: in the inbox or waiting in the engine (approximate: the two
        counts are read at slightly different moments)."""
        return self._inbox.qsize() + self.snapshot.num_waiting

    async def submit(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        t_arrival: float | None = None,
        grammar: Any | None = None,
    ) -> RequestStream:
        """Queue a request in the engine; returns its stream once the engine has accepted it.
        A request with a grammar brings it compiled (`grammar`): the engine thread never
        compiles one (a compile can take seconds, and every request would wait for it).

        Raises what `llm.add_request` raises (ValueError / TypeError: nothing was queued). If the
        caller is cancelled while waiting, the request is aborted as soon as it exists.
        """
        if params.grammar_spec is not None and grammar is None:
            raise ValueError("a request with a grammar must bring it compiled")
        loop = self._running_loop()
        added: asyncio.Future[str] = loop.create_future()
        ids = list(prompt_token_ids)
        arrival = time.perf_counter() if t_arrival is None else t_arrival
        stream_box: list[RequestStream] = []

        def on_added(rid: str | None, exc: BaseException | None) -> None:  # asyncio side
            if exc is not None:
                if not added.done():
                    added.set_exception(exc)
                return
            assert rid is not None
            if added.cancelled():
                self.abort(rid)
                return
            if self._ended_with is not None:
                self.abort(rid)
                added.set_exception(self._ended_with)
                return
            stream = RequestStream(rid, arrival, cache_salt=cache_salt)
            self._streams[rid] = stream
            stream_box.append(stream)
            added.set_result(rid)

        def add() -> None:  # engine thread
            try:
                rid = self.llm.add_request(ids, params, cache_salt=cache_salt, grammar=grammar)
            except Exception as exc:
                loop.call_soon_threadsafe(on_added, None, exc)
                return
            loop.call_soon_threadsafe(on_added, rid, None)

        self._inbox.put(add)
        await added
        return stream_box[0]

    def abort(self, request_id: str, *, keep_stream: bool = False) -> None:
        """Abort a request (its blocks come back). Its updates stop unless `keep_stream`, which
        keeps them coming up to the final one (the aborted request's output, with its stats)."""
        streams = self._streams
        stream = streams.get(request_id) if keep_stream else streams.pop(request_id, None)
        if stream is not None and stream.finished:
            return

        def abort() -> None:  # engine thread
            if self.llm.abort_request(request_id):
                self._must_step = True

        self._inbox.put(abort)

    def release(self, stream: RequestStream) -> None:
        """The caller is done with `stream`: abort the request if it has not finished."""
        if not stream.finished:
            self.abort(stream.request_id)
        self._streams.pop(stream.request_id, None)

    def call(self, fn: Callable[[LLM], T]) -> concurrent.futures.Future[T]:
        """Run `fn(llm)` on the engine thread between two steps (any thread may call this; e.g.
        `llm.cache.check_integrity`). From asyncio: `await asyncio.wrap_future(engine.call(fn))`."""
        done: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:  # engine thread
            if not done.set_running_or_notify_cancel():
                return
            try:
                done.set_result(fn(self.llm))
            except Exception as exc:
                done.set_exception(exc)

        self._inbox.put(run)
        return done

    def _deliver(self, updates: list[RequestUpdate]) -> None:  # asyncio side
        if any(update.new_token_ids for update in updates):
            self.t_last_token = time.perf_counter()
        for update in updates:
            stream = self._streams.get(update.request_id)
            if stream is None:
                continue  # released by its caller (disconnect, stop string)
            if update.output is not None:
                stream.finished = True
                del self._streams[update.request_id]
            self._on_update(stream, update)
            stream.updates.put_nowait(update)

    def end_all(self, exc: BaseException) -> None:
        """End every live request with `exc` (the last item of its stream) and abort it in the
        engine; a request submitted later gets `exc` at once (a server shutting down)."""
        self._ended_with = exc
        self._fail_all(exc)

    def _fail_all(self, exc: BaseException) -> None:  # asyncio side
        for rid, stream in list(self._streams.items()):
            stream.updates.put_nowait(exc)
            self.abort(rid)

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("the engine loop has not been started")
        return self._loop

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        loop = self._running_loop()
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
                self._publish()
            if not (self.llm.has_unfinished_requests() or self._must_step):
                continue
            self._must_step = False
            try:
                updates = self.llm.step()
            except Exception as exc:
                # step() fails the requests of a faulty step itself; this is a bug in that
                # promise: fail every live request rather than leave its client hanging.
                logger.exception("engine step raised")
                loop.call_soon_threadsafe(self._fail_all, exc)
                continue
            self._publish()
            if updates:
                loop.call_soon_threadsafe(self._deliver, updates)

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command is None:
                return
            command()

    def _publish(self) -> None:
        """Replace `snapshot` with the engine's current counters."""
        scheduler = self.llm.scheduler
        stats = self.llm.cache.stats()
        self.snapshot = EngineSnapshot(
            num_waiting=self.llm.num_waiting_requests,
            num_running=scheduler.num_running,
            num_free_blocks=stats.num_free_blocks,
            num_evictable_blocks=stats.num_evictable_blocks,
            num_in_use_blocks=stats.num_in_use_blocks,
            num_evicted_blocks=stats.num_evicted_blocks,
            num_preemptions=scheduler.num_preemptions,
            hit_tokens_by_tier=_hit_tokens_by_tier(stats),
            tier_moves=tier_moves(*self.llm.tier_ios),
        )


def tier_moves(*tier_ios: Any) -> dict[str, tuple[int, float]]:
    """Bytes and seconds of each kind of move since start, summed over the KV groups' movers
    (one per KV cache group; the live page shows the other groups' apart)."""
    moves: dict[str, tuple[int, float]] = {}
    for tier_io in tier_ios:
        for kind, t in ({} if tier_io is None else tier_io.totals).items():
            nbytes, seconds = moves.get(kind, (0, 0.0))
            moves[kind] = (nbytes + t.nbytes, seconds + t.seconds)
    return moves


def _hit_tokens_by_tier(stats: CacheStats) -> dict[str, int]:
    """Prompt tokens served from each tier since start (the device: the tree's own hits)."""
    lower = stats.num_host_hit_tokens + stats.num_disk_hit_tokens
    return {
        "device": stats.num_hit_tokens - lower,
        "host": stats.num_host_hit_tokens,
        "disk": stats.num_disk_hit_tokens,
    }
