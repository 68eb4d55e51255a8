"""The server's grammar compiles: in worker processes, within a time limit, into a cache with a
byte budget, and never on the engine thread.

    request ──► GrammarPool.compile(spec) ──► cached? the grammar at once
                   │ (one compile per spec at a time; a spec that timed out is refused at once)
                   ▼
                a slot thread ──► its worker process (`grammar_worker`) ──► serialize_json()
                   │  over its time: the process is killed, its thread and slot freed
                   ▼
                deserialize_json() ──► GrammarCache (memory_size_bytes, LRU) ──► the request,
                which carries the compiled grammar to the engine (`EngineLoop.submit`)

Why processes: xgrammar's compile cannot be interrupted, and a thread cannot be stopped, so a
grammar built to compile for minutes (a regex of a few thousand dots) would hold its thread,
and every later compile would wait behind it; a shutdown would wait for it too. A process is
killed. At most `num_workers` processes exist; each is started when a compile first needs it
(xgrammar with torch takes seconds to import) and replaced as soon as a kill took it. Neither
start nor the wait for a free worker counts in a compile's time; at most
`MAX_WAITING_PER_WORKER` compiles per worker may wait (more: `CompilesBusy`, a 503).

The compiled grammar crosses the pipe as xgrammar's JSON (`serialize_json`): about its own size
in bytes, serialized and deserialized at roughly 20-40 MB/s with the GIL released, so a worker
refuses one over a quarter of the cache's budget (`MAX_GRAMMAR_SHARE`) before sending it.
Across the engine-process split the same JSON is what a grammar travels as.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import logging
import os
import queue
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from functools import partial
from typing import Any

from radixkv.engine.sampling.grammar import (
    GrammarCache,
    GrammarError,
    SerializedGrammar,
    import_xgrammar,
)
from radixkv.serve import grammar_worker as wire

logger = logging.getLogger(__name__)

MAX_GRAMMAR_SHARE = 0.25  # of the cache's budget, the most one compiled grammar may take
MAX_WAITING_PER_WORKER = 8
MAX_REMEMBERED_TIMEOUTS = 1024  # specs (their digests) refused at once for having timed out
START_TIMEOUT_S = 120.0  # for a worker to import xgrammar, on a loaded machine
# `-c`'s first sys.path entry is the working directory: dropped, so that a checkout's
# top-level `kernels/` is never imported as `kernels` (see PLATFORM notes) by transformers.
WORKER_BOOT = "import sys; sys.path.pop(0); from radixkv.serve.grammar_worker import main; main()"


class CompileTimeout(GrammarError):
    """A grammar that did not compile within the pool's time limit."""


class CompilesBusy(Exception):
    """Too many compiles are waiting for a worker: retry later."""


class GrammarPool:
    """Compiled grammars for one tokenizer and vocabulary (see the module docstring).

    `num_workers` slot threads (daemons, started on the first compile) take compiles from one
    queue; each owns at most one worker process, started when its first compile comes and
    again as soon as a kill took it (so that the next compile finds it ready).

    Thread rules: `compile` is called on the asyncio loop; the slot threads run `_serve_slot`;
    `close` from any thread.

    Invariants (`check_integrity`): at most `num_workers` worker processes, each alive while
    its slot is idle; the cache within its budget; at most MAX_REMEMBERED_TIMEOUTS timeouts."""

    def __init__(
        self,
        tokenizer: Any | None,
        vocab_size: int,
        *,
        num_workers: int,
        timeout_s: float,
        cache_bytes: int,
        serialized: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        # True: grammars stay as the workers send them (`SerializedGrammar`), for an engine in
        # another process, which loads them itself; the front end never deserializes one.
        self.serialized = serialized
        self.vocab_size = vocab_size
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.cache = GrammarCache(cache_bytes)
        self.max_grammar_bytes = int(cache_bytes * MAX_GRAMMAR_SHARE)
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._slots: list[threading.Thread] = []
        self._lock = threading.Lock()  # guards _workers, _busy and closed
        self._workers: dict[int, _Worker] = {}  # slot -> its process
        self._busy: set[int] = set()  # slots running a compile
        self._info_lock = threading.Lock()
        self._info: tuple[Any, bytes] | None = None  # xgrammar TokenizerInfo and its JSON
        self._pending: dict[tuple[str, str], asyncio.Future[Any]] = {}  # asyncio side
        self._timed_out: OrderedDict[bytes, None] = OrderedDict()  # asyncio side
        self.closed = False
        self.num_started = 0  # worker processes started, and ended (for tests and logs)
        self.num_killed = 0

    # ------------------------------------------------------------------ asyncio side

    async def compile(self, spec: tuple[str, str]) -> Any:
        """The CompiledGrammar of `spec`. Raises GrammarError (CompileTimeout among them) for
        one that cannot be compiled in time, CompilesBusy when too many wait."""
        compiled = self.cache.get(spec)
        if compiled is not None:
            return compiled
        if _digest(spec) in self._timed_out:  # as SGLang caches a timed-out grammar
            raise CompileTimeout(f"{spec[0]} did not compile within {self.timeout_s:g} s before")
        pending = self._pending.get(spec)
        if pending is None:
            if self.closed:
                raise GrammarError("the server is shutting down")
            if len(self._pending) >= MAX_WAITING_PER_WORKER * self.num_workers:
                raise CompilesBusy(f"{len(self._pending)} grammars are compiling or waiting")
            done: concurrent.futures.Future[Any] = concurrent.futures.Future()
            self._start_slots()
            self._jobs.put((spec, done))
            pending = asyncio.wrap_future(done)
            self._pending[spec] = pending
            pending.add_done_callback(partial(self._settled, spec))
        return await asyncio.shield(pending)  # a client that leaves does not end the compile

    def _settled(self, spec: tuple[str, str], done: asyncio.Future[Any]) -> None:
        del self._pending[spec]
        if not done.cancelled() and isinstance(done.exception(), CompileTimeout):
            self._timed_out[_digest(spec)] = None
            while len(self._timed_out) > MAX_REMEMBERED_TIMEOUTS:
                self._timed_out.popitem(last=False)

    def _start_slots(self) -> None:
        while len(self._slots) < self.num_workers:
            slot = len(self._slots)
            name = f"radixkv-grammar-{slot}"
            thread = threading.Thread(target=self._serve_slot, args=(slot,), name=name, daemon=True)
            self._slots.append(thread)
            thread.start()

    def close(self) -> None:
        """Kill every worker now (compiles in flight fail), refuse what comes later."""
        with self._lock:
            self.closed = True
            workers = list(self._workers.values())
        for worker in workers:
            worker.kill()  # its slot thread reads the end of the pipe, then closes it
        for _ in self._slots:
            self._jobs.put(None)

    def check_integrity(self) -> None:
        with self._lock:
            assert len(self._workers) <= self.num_workers, (self._workers, self.num_workers)
            assert set(self._workers) <= set(range(len(self._slots))), self._workers
            if not self.closed:
                for slot, worker in self._workers.items():
                    assert slot in self._busy or worker.alive, f"slot {slot}: its worker is gone"
        assert len(self._timed_out) <= MAX_REMEMBERED_TIMEOUTS
        self.cache.check_integrity(self.vocab_size)

    # ------------------------------------------------------------------ slot threads

    def _serve_slot(self, slot: int) -> None:
        while (job := self._jobs.get()) is not None:
            spec, done = job
            with self._lock:
                self._busy.add(slot)
            try:
                done.set_result(self._compile(slot, spec))
            except BaseException as exc:  # the request's to report; the slot goes on
                done.set_exception(exc)
            finally:
                with self._lock:
                    self._busy.discard(slot)
            if slot not in self._workers and not self.closed:
                self._start_quietly(slot)  # a kill took it: the next compile finds one ready
        self._drop(slot)

    def _compile(self, slot: int, spec: tuple[str, str]) -> Any:
        compiled = self.cache.get(spec)  # compiled while this one waited
        if compiled is not None:
            return compiled
        info = self._tokenizer_info()[0]
        worker = self._workers.get(slot) or self._start(slot)
        request = json.dumps({"kind": spec[0], "text": spec[1]}).encode()
        try:
            reply = worker.ask(request, self.timeout_s)
        except TimeoutError:
            self._drop(slot)
            raise CompileTimeout(f"{spec[0]} did not compile within {self.timeout_s:g} s") from None
        except (EOFError, OSError):
            self._drop(slot)
            if self.closed:
                raise GrammarError("the server is shutting down") from None
            raise GrammarError(f"{spec[0]}: the compiler's process died on it") from None
        if reply[:1] != wire.OK:
            raise GrammarError(reply[1:].decode())
        text = reply[1:].decode()
        if self.serialized:
            compiled: Any = SerializedGrammar(text, self.vocab_size)
        else:
            compiled = import_xgrammar().CompiledGrammar.deserialize_json(text, info)
        self.cache.put(spec, compiled)
        return compiled

    def _tokenizer_info(self) -> tuple[Any, bytes]:
        with self._info_lock:  # made once, by the first compile (xgrammar imports in seconds)
            if self._info is None:
                if self.tokenizer is None:
                    raise GrammarError("this model has no tokenizer: no structured output")
                xgr = import_xgrammar()
                size = self.vocab_size
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=size)
                self._info = (info, info.serialize_json().encode())
            return self._info

    def _start(self, slot: int) -> _Worker:
        """A new worker process for `slot`, ready; GrammarError when it cannot start."""
        if self.closed:
            raise GrammarError("the server is shutting down")
        setup = json.dumps({"vocab_size": self.vocab_size, "max_bytes": self.max_grammar_bytes})
        worker = _Worker(setup.encode(), self._tokenizer_info()[1])
        with self._lock:
            self._workers[slot] = worker
            self.num_started += 1
            closed = self.closed
        try:
            if closed:
                raise EOFError("closed while it started")
            worker.wait_ready(START_TIMEOUT_S)
        except (TimeoutError, EOFError, OSError):
            self._drop(slot)
            message = "the grammar compiler could not start (see the server log)"
            raise GrammarError(message) from None
        return worker

    def _start_quietly(self, slot: int) -> None:
        try:
            self._start(slot)
        except GrammarError:
            logger.warning("a grammar worker could not start; the next compile tries again")

    def _drop(self, slot: int) -> None:
        """Kill the slot's worker, if any, and close its pipes (its slot thread only)."""
        with self._lock:
            worker = self._workers.pop(slot, None)
            self.num_killed += worker is not None
        if worker is not None:
            worker.kill()
            worker.close_pipes()


_Job = tuple[tuple[str, str], "concurrent.futures.Future[Any]"]


class _Worker:
    """One worker process and its two pipes (the parent's side of `grammar_worker`)."""

    def __init__(self, setup: bytes, info_json: bytes) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", WORKER_BOOT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # the terminal's Ctrl-C is the server's to handle, not its
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self._stdin = self.process.stdin
        self._out = self.process.stdout.fileno()
        wire.write_frame(self._stdin, setup)
        wire.write_frame(self._stdin, info_json)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self, timeout_s: float) -> None:
        if self._read_frame(timeout_s) != wire.READY:
            raise EOFError("the worker did not start")

    def ask(self, request: bytes, timeout_s: float) -> bytes:
        """The reply to `request`; TimeoutError when it is not all in within `timeout_s`,
        EOFError / OSError when the process died."""
        wire.write_frame(self._stdin, request)
        return self._read_frame(timeout_s)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def close_pipes(self) -> None:
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()

    def _read_frame(self, timeout_s: float) -> bytes:
        deadline = time.monotonic() + timeout_s
        head = self._read_exactly(wire.FRAME_HEAD_BYTES, deadline)
        return self._read_exactly(wire.frame_length(head), deadline)

    def _read_exactly(self, size: int, deadline: float) -> bytes:
        data = bytearray()
        while len(data) < size:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self._out], [], [], remaining)[0]:
                raise TimeoutError
            chunk = os.read(self._out, min(size - len(data), 1 << 20))
            if not chunk:
                raise EOFError("the worker's pipe closed")
            data += chunk
        return bytes(data)


def _digest(spec: tuple[str, str]) -> bytes:
    return hashlib.sha256(json.dumps(spec).encode()).digest()
