"""The engine on a thread of the server's own process: an `EngineWorker` fed through its inbox.

    HTTP handlers (asyncio)                          engine thread
    submit() / abort() ──► closures in the inbox ──► EngineWorker.run: run them, then llm.step()
    RequestStream queues ◄── call_soon_threadsafe ◄── one batch of RequestUpdates per step

What a `create_app(llm, ...)` runs (the tests, and a caller that holds its `LLM`); `radixkv serve`
runs the engine in a process of its own (`engine_client`). The updates bring their text: the
LLM detokenizes on the engine thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from radixkv.engine.llm import LLM, RequestUpdate
from radixkv.engine.sampling_params import SamplingParams
from radixkv.serve.engine_handle import EngineHandle
from radixkv.serve.engine_snapshot import EngineSnapshot
from radixkv.serve.engine_worker import EngineWorker

T = TypeVar("T")


class EngineLoop(EngineHandle):
    """Drives `llm.step()` in a background thread for every HTTP request at once (see
    `EngineHandle` for the thread rules; everything that touches the LLM runs on the engine
    thread)."""

    def __init__(self, llm: LLM) -> None:
        super().__init__()
        self.llm = llm
        self._worker = EngineWorker(
            llm, deliver=self._from_engine_deliver, publish=self._set, fail_all=self._from_fail
        )
        self._thread: threading.Thread | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the engine thread; updates are delivered on `loop`."""
        if self._thread is not None:
            raise RuntimeError("the engine loop is already running")
        self._loop = loop
        self.snapshot = self._worker.snapshot()  # /metrics shows the real pool from the start
        self._thread = threading.Thread(target=self._worker.run, name="radixkv-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the engine thread to finish its current step and exit; waits up to `timeout`."""
        self._worker.stop()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_queued(self) -> int:
        return self._worker.num_inbox + self.snapshot.num_waiting

    def call(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        done: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:  # engine thread
            if not done.set_running_or_notify_cancel():
                return
            try:
                done.set_result(self._worker.call(fn, *args))
            except Exception as exc:
                done.set_exception(exc)

        self._worker.put(run)
        return done

    def _send_add(
        self,
        token: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None,
        grammar: Any | None,
    ) -> None:
        loop = self._running_loop()

        def add() -> None:  # engine thread
            try:
                rid = self._worker.add(prompt_token_ids, params, cache_salt, grammar)
            except Exception as exc:
                loop.call_soon_threadsafe(self._added, token, None, exc)
                return
            loop.call_soon_threadsafe(self._added, token, rid, None)

        self._worker.put(add)

    def _send_abort(self, request_id: str) -> None:
        self._worker.put(lambda: self._worker.abort(request_id))

    # ------------------------------------------------------------------ engine thread

    def _set(self, snapshot: EngineSnapshot) -> None:
        self.snapshot = snapshot

    def _from_engine_deliver(self, updates: list[RequestUpdate]) -> None:
        self._running_loop().call_soon_threadsafe(self._deliver, updates)

    def _from_fail(self, exc: BaseException) -> None:
        self._running_loop().call_soon_threadsafe(self._fail_all, exc)
