"""The server's side of its engine: request streams on the asyncio loop, whatever carries them.

    HTTP handlers (asyncio)                        the engine (a thread, or a process of its own)
    submit() / abort() / call() ──► the transport ──► EngineWorker: commands, then llm.step()
    RequestStream queues ◄── _added / _deliver ◄── the transport ◄── updates, one batch per step

`EngineHandle` keeps every live request's stream and hands it its updates in step order;
`engine_loop.EngineLoop` carries commands to a worker thread of this process,
`engine_client.EngineClient` to an engine process over ZeroMQ. The asyncio side never waits on a
step: it awaits futures and queues the transport fills on the loop's thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from radixkv.engine.model.detokenizer import IncrementalDetokenizer
from radixkv.serve.engine_snapshot import EngineSnapshot

if TYPE_CHECKING:
    from radixkv.engine.records import RequestUpdate
    from radixkv.engine.sampling_params import SamplingParams

T = TypeVar("T")

# on_added(request id or None, the error add_request raised or None), on the asyncio loop
Added = Callable[[str | None, BaseException | None], None]


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
    # The reply's text, made here from its tokens when the engine sends tokens only (an engine
    # process: detokenizing is the front end's work); None: the updates bring their text.
    detok: IncrementalDetokenizer | None = None


class EngineHandle:
    """Request streams over an engine (see the module docstring). Subclasses carry commands:
    `_send_add`, `_send_abort`, `call`, and report back on the loop's thread through `_added`,
    `_deliver` and `_fail_all`.

    Thread rules: `submit`, `abort`, `release` and `end_all` are called from the asyncio loop's
    thread (`call` from any thread). `snapshot` is replaced (never mutated) as the engine
    publishes: any thread may read it."""

    # Whether the engine takes grammars as xgrammar's JSON (an engine process loads them
    # itself) rather than compiled: the front end's grammar pool then keeps their JSON.
    ships_serialized_grammars = False

    def __init__(self) -> None:
        self.snapshot = EngineSnapshot()
        # asyncio side, per delivered update (the server's metrics set it)
        self.on_update: Callable[[RequestStream, RequestUpdate], None] = _ignore
        self._streams: dict[str, RequestStream] = {}  # asyncio side only
        self._adding: dict[int, Added] = {}  # asyncio side: adds the engine has not answered
        self._tokens = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ended_with: BaseException | None = None  # asyncio side: set by end_all
        # asyncio side: perf_counter() when the last token of any request was delivered
        self.t_last_token: float | None = None

    # ------------------------------------------------------------------ the transport's part

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        raise NotImplementedError

    def stop(self, timeout: float = 10.0) -> None:
        raise NotImplementedError

    @property
    def is_alive(self) -> bool:
        raise NotImplementedError

    @property
    def num_queued(self) -> int:
        """Requests not yet admitted: on their way to the engine or waiting in it (approximate:
        the counts are read at slightly different moments)."""
        raise NotImplementedError

    def call(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Run `fn(llm, *args)` on the engine between two steps (any thread may call this; an
        engine process needs `fn` and `args` picklable: a module-level function). From
        asyncio: `await asyncio.wrap_future(engine.call(fn))`."""
        raise NotImplementedError

    def _send_add(
        self,
        token: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None,
        grammar: Any | None,
    ) -> None:
        raise NotImplementedError

    def _send_abort(self, request_id: str) -> None:
        raise NotImplementedError

    def _new_stream(
        self, request_id: str, t_arrival: float, cache_salt: str | None
    ) -> RequestStream:
        return RequestStream(request_id, t_arrival, cache_salt=cache_salt)

    # ------------------------------------------------------------------ asyncio side

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
        A request with a grammar brings it compiled (`grammar`): the engine never compiles one
        (a compile can take seconds, and every request would wait for it).

        Raises what `llm.add_request` raises (ValueError / TypeError: nothing was queued). If the
        caller is cancelled while waiting, the request is aborted as soon as it exists.
        """
        if params.grammar_spec is not None and grammar is None:
            raise ValueError("a request with a grammar must bring it compiled")
        loop = self._running_loop()
        added: asyncio.Future[RequestStream] = loop.create_future()
        arrival = time.perf_counter() if t_arrival is None else t_arrival

        def on_added(rid: str | None, exc: BaseException | None) -> None:  # asyncio side
            if exc is not None:
                if not added.done():
                    added.set_exception(exc)
                return
            assert rid is not None
            if added.cancelled():
                self._send_abort(rid)
                return
            if self._ended_with is not None:
                self._send_abort(rid)
                added.set_exception(self._ended_with)
                return
            stream = self._new_stream(rid, arrival, cache_salt)
            self._streams[rid] = stream
            added.set_result(stream)

        if self._ended_with is not None:
            raise self._ended_with
        token = next(self._tokens)
        self._adding[token] = on_added
        self._send_add(token, list(prompt_token_ids), params, cache_salt, grammar)
        return await added

    def abort(self, request_id: str, *, keep_stream: bool = False) -> None:
        """Abort a request (its blocks come back). Its updates stop unless `keep_stream`, which
        keeps them coming up to the final one (the aborted request's output, with its stats)."""
        streams = self._streams
        stream = streams.get(request_id) if keep_stream else streams.pop(request_id, None)
        if stream is not None and stream.finished:
            return
        self._send_abort(request_id)

    def release(self, stream: RequestStream) -> None:
        """The caller is done with `stream`: abort the request if it has not finished."""
        if not stream.finished:
            self.abort(stream.request_id)
        self._streams.pop(stream.request_id, None)

    def end_all(self, exc: BaseException) -> None:
        """End every live request with `exc` (the last item of its stream) and abort it in the
        engine; a request submitted later gets `exc` at once (a server shutting down)."""
        self._ended_with = exc
        self._fail_all(exc)

    def _added(self, token: int, rid: str | None, exc: BaseException | None) -> None:
        on_added = self._adding.pop(token, None)
        if on_added is not None:
            on_added(rid, exc)

    def _deliver(self, updates: list[RequestUpdate]) -> None:
        if any(update.new_token_ids for update in updates):
            self.t_last_token = time.perf_counter()
        for update in updates:
            stream = self._streams.get(update.request_id)
            if stream is None:
                continue  # released by its caller (disconnect, stop string)
            if stream.detok is not None:
                update = with_text(stream.detok, update)
            if update.output is not None:
                stream.finished = True
                del self._streams[update.request_id]
            self.on_update(stream, update)
            stream.updates.put_nowait(update)

    def _fail_all(self, exc: BaseException) -> None:
        for rid, stream in list(self._streams.items()):
            stream.updates.put_nowait(exc)
            self.abort(rid)

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("the engine has not been started")
        return self._loop


def with_text(detok: IncrementalDetokenizer, update: RequestUpdate) -> RequestUpdate:
    """`update` with the text its tokens complete (and, at the end, the reply's whole text)."""
    text = detok.push(update.new_token_ids)
    output = update.output
    if output is not None:
        text += detok.finish()
        output = replace(output, text=detok.emitted)
    return replace(update, new_text=text, output=output)


def _ignore(stream: RequestStream, update: RequestUpdate) -> None:
    pass
