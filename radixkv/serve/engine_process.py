"""`radixkv serve`'s engine in a process of its own: the model, the scheduler, the forward, sampling
and the tiers, stepped by an `EngineWorker`, fed over ZeroMQ by the server's front end
(`engine_client`), which keeps the HTTP, templates, tokenizing, grammar compiles, detokenizing and
streaming in its own process: on a machine of few cores the front end's Python then never waits
for the forward's core, nor the forward for the front end's interpreter.

    front end ──PUSH──► commands ──► receiver thread ──► worker inbox ──► EngineWorker.run
    front end ◄──PULL── results  ◄── (any thread, one lock) ◄── added / snapshot / updates / ...

Messages are tuples, as bytes by `wire` (which reads nothing from outside the project):

    front end -> engine: ("init", model, settings) once; ("add", token, prompt ids, params,
        cache_salt, grammar); ("abort", request id); ("call", call id, fn, args); ("stop",)
    engine -> front end: ("ready", ServedModel, EngineSnapshot) or ("failed", is_model_error,
        message) once; ("added", token, request id, error); ("snapshot", EngineSnapshot);
        ("updates", [RequestUpdate]); ("fail_all", error); ("result", call id, value, error);
        ("stopped",)

A grammar arrives serialized (`SerializedGrammar`, compiled by the front end's worker pool) and is
loaded on the receiver thread, not the worker's: xgrammar releases the GIL while it loads, so the
forward goes on. The engine runs with `detokenize=False`: updates carry token ids, the front end
makes their text. When the front end's process dies the engine notices within a second, stops
(its shutdown services run: the disk tier is saved) and exits.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from radixkv.serve import wire

logger = logging.getLogger(__name__)

# How the front end starts this module: `-c`'s first sys.path entry is the working directory,
# dropped so that a checkout's top-level `kernels/` is never imported as `kernels` by
# transformers (see the project's platform notes).
BOOT = "import sys; sys.path.pop(0); from radixkv.serve.engine_process import main; main()"
PARENT_CHECK_S = 1.0


class Outbox:
    """The results socket, for every thread of the engine (a ZeroMQ socket is not thread-safe)."""

    def __init__(self, socket: Any) -> None:
        self._socket = socket
        self._lock = threading.Lock()

    def send(self, message: tuple[Any, ...]) -> None:
        data = wire.dumps(message)
        with self._lock:
            self._socket.send(data, copy=False)


def main() -> None:
    """The engine process: `python -c BOOT COMMANDS_ADDRESS RESULTS_ADDRESS`."""
    import zmq

    commands_address, results_address = sys.argv[1], sys.argv[2]
    parent = os.getppid()
    context = zmq.Context()
    commands = context.socket(zmq.PULL)
    commands.setsockopt(zmq.RCVHWM, 0)
    commands.connect(commands_address)
    results = context.socket(zmq.PUSH)
    results.setsockopt(zmq.SNDHWM, 0)
    results.setsockopt(zmq.LINGER, 5000)  # the last results go out before the process ends
    results.connect(results_address)
    out = Outbox(results)
    try:
        _, model, settings, log_level = wire.loads(commands.recv())
        logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
        serve(model, settings, commands, out, parent)
    finally:
        commands.close(linger=0)
        results.close()
        context.term()


def serve(model: Any, settings: dict[str, Any], commands: Any, out: Outbox, parent: int) -> None:
    """Load the model, say ready (or why not), then step until told to stop or orphaned."""
    from radixkv.engine import LLM, ModelLoadError, freeze_startup_heap
    from radixkv.serve.engine_worker import EngineWorker
    from radixkv.serve.served_model import ServedModel

    try:
        llm = LLM(model, **settings, detokenize=False)
    except Exception as exc:  # the front end prints it as the model's or the options' error
        out.send(("failed", isinstance(exc, ModelLoadError), str(exc)))
        return
    freeze_startup_heap()
    worker = EngineWorker(
        llm,
        deliver=lambda updates: out.send(("updates", [_sendable(u) for u in updates])),
        publish=lambda snapshot: out.send(("snapshot", snapshot)),
        fail_all=lambda exc: out.send(("fail_all", _sendable_error(exc))),
    )
    out.send(("ready", ServedModel.of(llm).without_tokenizer(), worker.snapshot()))
    receiver = threading.Thread(
        target=receive, args=(commands, worker, out, parent), name="radixkv-receive", daemon=True
    )
    receiver.start()
    try:
        worker.run()
    finally:
        close_services(llm)
        out.send(("stopped",))


def receive(commands: Any, worker: Any, out: Outbox, parent: int) -> None:
    """The receiver thread: each command becomes a closure in the worker's inbox (a grammar is
    loaded here first); `stop`, or the front end's death, stops the worker."""
    loader = _GrammarLoader(worker.llm)
    while True:
        if not commands.poll(int(PARENT_CHECK_S * 1000)):
            if os.getppid() != parent:
                logger.warning("the server's front end is gone: the engine stops")
                worker.stop()
                return
            continue
        message = wire.loads(commands.recv())
        kind = message[0]
        if kind == "stop":
            worker.stop()
            return
        if kind == "add":
            _, token, ids, params, cache_salt, grammar = message
            try:
                grammar = loader.load(params, grammar)
            except Exception as exc:  # a grammar that cannot be loaded: that request's 400
                out.send(("added", token, None, _sendable_error(exc)))
                continue
            worker.put(_add(worker, out, token, ids, params, cache_salt, grammar))
        elif kind == "abort":
            worker.put(lambda rid=message[1]: worker.abort(rid))
        elif kind == "call":
            _, call_id, fn, args = message
            worker.put(_call(worker, out, call_id, fn, args))


def _add(
    worker: Any, out: Outbox, token: int, ids: list[int], params: Any, salt: Any, grammar: Any
) -> Callable[[], None]:
    def add() -> None:  # the worker's thread
        try:
            rid = worker.add(ids, params, salt, grammar)
        except Exception as exc:
            out.send(("added", token, None, _sendable_error(exc)))
            return
        out.send(("added", token, rid, None))

    return add


def _call(
    worker: Any, out: Outbox, call_id: int, fn: Callable[..., Any], args: tuple[Any, ...]
) -> Callable[[], None]:
    def call() -> None:  # the worker's thread
        try:
            value = worker.call(fn, *args)
        except Exception as exc:
            out.send(("result", call_id, None, _sendable_error(exc)))
            return
        out.send(("result", call_id, value, None))

    return call


def shutdown_services(llm: Any) -> list[Callable[[], None]]:
    """What the engine's shutdown owes its subscribers, in order, after its last step: the last
    KV events go out (the publisher of `--kv-events` closes), and the disk tier takes every
    cached full block for the next start over its folder."""
    services = [] if llm.kv_events is None else [llm.kv_events.close]
    if llm.config.kv_cache_dir is not None:
        services.append(llm.save_kv_cache)
    return services


def close_services(llm: Any) -> None:
    services = shutdown_services(llm)
    for close in services:
        close()
    logger.info("engine process stopped, %d shutdown service(s) run", len(services))


class _GrammarLoader:
    """Serialized grammars made loadable by this process's tokenizer, cached by spec."""

    def __init__(self, llm: Any) -> None:
        self._llm = llm
        self._loaded: Any = None  # a GrammarLoader, made on the first grammar

    def load(self, params: Any, grammar: Any) -> Any:
        from radixkv.engine.sampling.grammar import GrammarLoader, SerializedGrammar

        if not isinstance(grammar, SerializedGrammar):
            return grammar
        if self._loaded is None:
            self._loaded = GrammarLoader(self._llm.tokenizer, self._llm.vocab_size)
        return self._loaded.load(params.grammar_spec, grammar)


def _sendable(update: Any) -> Any:
    if update.error is None:
        return update
    from dataclasses import replace

    return replace(update, error=_sendable_error(update.error))


def _sendable_error(exc: BaseException) -> BaseException:
    """`exc`, or where the front end could not read it back, a RuntimeError that says what it
    was."""
    if wire.travels(exc):
        return exc
    return RuntimeError(f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
