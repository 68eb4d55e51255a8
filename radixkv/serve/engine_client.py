"""The server's front end to an engine in a process of its own (`engine_process`, whose docstring
has the messages): it starts the process, waits until the model is loaded, then carries
commands there and results back.

    EngineClient.start_process(model, settings)   the process starts and loads the model; the
                                                   ServedModel it sends back (tokenizer included)
                                                   is what the front end knows of the model
    EngineClient.start(loop)                       a receiver thread hands results to the loop
    submit / abort / call                          over a PUSH socket (one lock), as `wire` bytes

The updates arrive as token ids; each stream detokenizes its own (`EngineHandle._deliver`), on the
front end's loop, as vLLM's API server does. A process that exits unasked is reported, never hung
on: every live request and pending call fails with `EngineDead`, `is_alive` turns False (so
`/health` answers 503) and `on_death` runs (the command line then shuts the server down).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from radixkv.engine.model.detokenizer import IncrementalDetokenizer
from radixkv.serve import wire
from radixkv.serve.engine_handle import EngineHandle, RequestStream
from radixkv.serve.engine_process import BOOT
from radixkv.serve.served_model import ServedModel

logger = logging.getLogger(__name__)

T = TypeVar("T")
POLL_S = 0.5  # how often the receiver looks at the process while nothing arrives


class EngineStartError(ValueError):
    """The engine process could not load its model or settings (the message says why, in the
    model's or the settings' words); `model_error` tells which."""

    def __init__(self, message: str, *, model_error: bool) -> None:
        super().__init__(message)
        self.model_error = model_error


class EngineDead(RuntimeError):
    """The engine process exited while the server was serving."""


class EngineClient(EngineHandle):
    """An engine process and the streams of its requests (see the module docstring and
    `EngineHandle` for the thread rules). Made by `start_process`."""

    ships_serialized_grammars = True  # the front end's grammar pool keeps their JSON for it

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        context: Any,
        commands: Any,
        results: Any,
        folder: str,
        model: ServedModel,
    ) -> None:
        super().__init__()
        self.model = model
        self.on_death: Callable[[BaseException], None] = lambda exc: None
        self._process = process
        self._context, self._commands, self._results = context, commands, results
        self._folder = folder
        self._send_lock = threading.Lock()
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._receiver: threading.Thread | None = None
        self._dead: BaseException | None = None
        self._stopping = False

    # ------------------------------------------------------------------ starting

    @classmethod
    def start_process(
        cls,
        model: Any,
        settings: dict[str, Any],
        *,
        log_level: str = "INFO",
        timeout_s: float | None = None,
    ) -> EngineClient:
        """Start an engine process over `model` (a path, an id, None: the embedded one) with
        the `EngineConfig` fields `settings`, and wait until it is ready. Raises
        EngineStartError for a model or settings it refused, RuntimeError when it died or took
        longer than `timeout_s`."""
        import zmq

        folder = tempfile.mkdtemp(prefix="radixkv-engine-")  # 0700: this user's alone
        context = zmq.Context()
        commands = context.socket(zmq.PUSH)
        commands.setsockopt(zmq.SNDHWM, 0)
        results = context.socket(zmq.PULL)
        results.setsockopt(zmq.RCVHWM, 0)
        commands_address = _bind(commands, folder, "commands")
        results_address = _bind(results, folder, "results")
        process = subprocess.Popen(
            [sys.executable, "-c", BOOT, commands_address, results_address],
            start_new_session=True,  # the terminal's Ctrl-C is the front end's to handle
        )
        try:
            commands.send(wire.dumps(("init", model, settings, log_level)))
            served, snapshot = _wait_ready(process, results, timeout_s)
        except BaseException:
            _kill(process)
            commands.close(linger=0)
            results.close(linger=0)
            context.term()
            shutil.rmtree(folder, ignore_errors=True)
            raise
        client = cls(process, context, commands, results, folder, served)
        client.snapshot = snapshot
        return client

    # ------------------------------------------------------------------ EngineHandle

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._receiver is not None:
            raise RuntimeError("the engine client is already running")
        self._loop = loop
        self._receiver = threading.Thread(
            target=self._receive, name="radixkv-engine-results", daemon=True
        )
        self._receiver.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the engine process to finish its step, close its services and exit; kill it
        after `timeout` seconds."""
        self._stopping = True
        if self._process.poll() is None:
            self._send(("stop",))
            try:
                self._process.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("the engine process did not stop within %.0f s: killed", timeout)
                _kill(self._process)
        if self._receiver is not None:
            self._receiver.join(timeout)
        self._commands.close(linger=0)
        self._results.close(linger=0)
        self._context.term()
        shutil.rmtree(self._folder, ignore_errors=True)

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._process.poll() is None

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def num_queued(self) -> int:
        return len(self._adding) + self.snapshot.num_waiting

    def call(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self._dead is not None:
            done.set_exception(self._dead)
            return done
        call_id = next(self._call_ids)
        self._calls[call_id] = done
        self._send(("call", call_id, fn, args))
        return done

    def _send_add(
        self,
        token: int,
        prompt_token_ids: list[int],
        params: Any,
        cache_salt: str | None,
        grammar: Any | None,
    ) -> None:
        if self._dead is not None:
            self._added(token, None, self._dead)
            return
        self._send(("add", token, prompt_token_ids, params, cache_salt, grammar))

    def _send_abort(self, request_id: str) -> None:
        if self._dead is None:
            self._send(("abort", request_id))

    def _new_stream(
        self, request_id: str, t_arrival: float, cache_salt: str | None
    ) -> RequestStream:
        detok = IncrementalDetokenizer(self.model.text.tokenizer)
        return RequestStream(request_id, t_arrival, cache_salt=cache_salt, detok=detok)

    # ------------------------------------------------------------------ internals

    def _send(self, message: tuple[Any, ...]) -> None:
        data = wire.dumps(message)
        with self._send_lock:
            self._commands.send(data, copy=False)

    def _receive(self) -> None:
        """The receiver thread: results to the loop, until the process stops or dies."""
        loop = self._running_loop()
        while True:
            if not self._results.poll(int(POLL_S * 1000)):
                if self._process.poll() is not None:
                    if not self._stopping:
                        self._died(loop)
                    return
                continue
            message = wire.loads(self._results.recv())
            kind = message[0]
            if kind == "snapshot":
                self.snapshot = message[1]
            elif kind == "updates":
                loop.call_soon_threadsafe(self._deliver, message[1])
            elif kind == "added":
                loop.call_soon_threadsafe(self._added, *message[1:])
            elif kind == "result":
                _, call_id, value, error = message
                done = self._calls.pop(call_id)
                if error is None:
                    done.set_result(value)
                else:
                    done.set_exception(error)
            elif kind == "fail_all":
                loop.call_soon_threadsafe(self._fail_all, message[1])
            elif kind == "stopped":
                return

    def _died(self, loop: asyncio.AbstractEventLoop) -> None:
        code = self._process.returncode
        exc = EngineDead(f"the engine process exited with code {code}")
        logger.error("%s: failing every request in flight", exc)
        self._dead = exc
        for done in self._calls.values():
            done.set_exception(exc)
        self._calls.clear()
        loop.call_soon_threadsafe(self._fail_everything, exc)

    def _fail_everything(self, exc: BaseException) -> None:  # asyncio side
        self._fail_all(exc)
        for token in list(self._adding):  # adds the engine will never answer
            self._added(token, None, exc)
        self.on_death(exc)


def _bind(socket: Any, folder: str, name: str) -> str:
    """Bind `socket` to an ipc path in `folder` (a TCP port on 127.0.0.1 where ipc does not
    exist); its address."""
    if sys.platform != "win32":
        address = f"ipc://{os.path.join(folder, name)}"
        socket.bind(address)
        return address
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    return f"tcp://127.0.0.1:{port}"


def _wait_ready(
    process: subprocess.Popen[bytes], results: Any, timeout_s: float | None
) -> tuple[ServedModel, Any]:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not results.poll(int(POLL_S * 1000)):
        if process.poll() is not None:
            raise RuntimeError(f"the engine process exited with code {process.returncode}")
        if deadline is not None and time.monotonic() > deadline:
            raise RuntimeError(f"the engine process was not ready within {timeout_s:.0f} s")
    message = wire.loads(results.recv())
    if message[0] == "failed":
        _, model_error, text = message
        raise EngineStartError(text, model_error=model_error)
    assert message[0] == "ready", message[0]
    return message[1].with_own_tokenizer(), message[2]


def _kill(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
    process.wait()
