"""`radixkv serve`: the OpenAI-compatible HTTP server.

radixkv serve                          the embedded default model on 127.0.0.1:8000
radixkv serve --model PATH_OR_ID --host 0.0.0.0 --port 8080 --max-num-seqs 32
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from radixkv.options import add_engine_options, engine_settings

if TYPE_CHECKING:
    from radixkv.engine import LLM


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixkv serve",
        description="OpenAI-compatible server (/v1/chat/completions, /v1/completions, /metrics) "
        "over the prefix-cached engine.",
    )
    # Prefill first by default: a server's clients wait for their first token.
    add_engine_options(parser, prefill_first=True)
    parser.add_argument(
        "--served-model-name", default=None, help="the `model` clients send (default: its name)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=256,
        help="requests waiting for admission before new ones get 503 (default 256)",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (the arguments after `serve`), load the model and serve until interrupted.
    Returns the exit code: 0 after a clean shutdown, 2 for bad arguments or a missing model."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # Imported here so that `radixkv serve --help` answers at once.
    import uvicorn

    from radixkv.engine import ModelNotFoundError
    from radixkv.serve.app import ServeConfig, create_app

    try:
        llm = build_llm(args)
        config = ServeConfig(
            model_name=args.served_model_name or llm.model_name,
            max_queued_requests=args.max_queued_requests,
        )
    except (ModelNotFoundError, ValueError, TypeError, ImportError, _zmq_error()) as exc:
        print(f"radixkv serve: {exc}", file=sys.stderr)
        return 2
    app = create_app(llm, config, on_shutdown=engine_services(llm))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _zmq_error() -> type[Exception]:
    """zmq.ZMQError (a `--kv-events` endpoint that cannot bind), or a stand-in without pyzmq."""
    try:
        import zmq
    except ImportError:
        return ValueError
    return zmq.ZMQError


def build_llm(args: argparse.Namespace) -> LLM:
    """The engine the parsed options describe. Raises what `LLM` raises."""
    from radixkv.engine import LLM

    return LLM(args.model, **engine_settings(args))


def engine_services(llm: LLM) -> list[Callable[[], None]]:
    """How to close the services that subscribe to the engine (the KV-event publisher of
    `--kv-events`, started with the engine); the server closes them after the engine thread
    stops, so the last events of a shutdown still go out."""
    services = [] if llm.kv_events is None else [llm.kv_events.close]
    if llm.config.kv_cache_dir is not None:
        services.append(llm.save_kv_cache)  # a restart over the directory finds the prefixes
    return services
