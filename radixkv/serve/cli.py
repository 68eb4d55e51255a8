"""`radixkv serve`: the OpenAI-compatible HTTP server.

radixkv serve                          the embedded default model on 127.0.0.1:8000
radixkv serve --model PATH_OR_ID --host 0.0.0.0 --port 8080 --max-num-seqs 32
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import os
import socket
import sys
import threading
import time
import webbrowser
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from radixkv.engine.config import EngineConfig
from radixkv.options import (
    add_engine_options,
    check_engine_options,
    engine_settings,
    format_bytes,
    name_flags,
    parse_bytes,
)
from radixkv.serve.config import ServeConfig

if TYPE_CHECKING:
    from radixkv.engine import LLM


def build_parser(prog: str = "radixkv serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="OpenAI-compatible server (/v1/chat/completions, /v1/completions, /metrics) "
        "over the prefix-cached engine.",
    )
    # Prefill first by default, and a prompt's chunk as large as the step: a server's clients
    # wait for their first token, and a prompt a little longer than a smaller chunk would take
    # two steps to its first token where one does.
    (step_tokens,) = (
        f.default for f in dataclasses.fields(EngineConfig) if f.name == "max_num_batched_tokens"
    )
    add_engine_options(parser, prefill_first=True, chunked_prefill_size=step_tokens)
    parser.add_argument(
        "--served-model-name", default=None, help="the `model` clients send (default: its name)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=_default("max_queued_requests"),
        help="requests waiting for admission before new ones get 503 (default %(default)s)",
    )
    parser.add_argument(
        "--admin-key",
        default=os.environ.get("RADIXKV_ADMIN_KEY") or None,
        help="turns on POST /flush_cache for clients that send 'Authorization: Bearer KEY' "
        "(default: the RADIXKV_ADMIN_KEY environment variable, which other users cannot read "
        "from the process list; unset: the route is off)",
    )
    parser.add_argument(
        "--ui",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the live page of the cache at / and its event stream (default: on when --host is "
        "a loopback address, off otherwise)",
    )
    parser.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a host name the page may be opened under (repeatable), besides IP addresses, "
        "localhost and --host: it answers no other, so that no web page can rebind a name of "
        "its own to this server and read the cache's text",
    )
    parser.add_argument(
        "--open", action="store_true", help="open the page in a web browser once serving"
    )
    parser.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine (model, scheduler, forward, sampling) in a process of its own, "
        "beside this one's HTTP, templates, tokenizing and streaming (default: on)",
    )
    _add_limit_options(parser)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    return parser


def main(argv: list[str] | None = None, prog: str = "radixkv serve") -> int:
    """Parse `argv` (the arguments after `serve`), load the model and serve until interrupted.
    Returns the exit code: 0 after a clean shutdown, 2 for bad arguments or a missing model.
    `prog`: the command as the user typed it (`radixkv chat --web` comes here too)."""
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:  # before torch, transformers and FastAPI are imported: they take seconds
        listener = preflight(args)
    except (ValueError, TypeError) as exc:
        print(f"{prog}: {name_flags(str(exc), _SERVE_FLAGS)}", file=sys.stderr)
        return 2
    from radixkv.serve.app import create_app
    from radixkv.serve.http_server import build_server

    try:
        engine, on_shutdown = start_engine(args)
        config = serve_config(args, args.served_model_name or _model_name(engine))
    except (ValueError, TypeError, ImportError, _zmq_error()) as exc:
        listener.close()
        # A model's error names the model in its own words; the others name fields: flags here.
        model_error = getattr(exc, "model_error", _is_model_error(exc))
        text = str(exc) if model_error else name_flags(str(exc), _SERVE_FLAGS)
        print(f"{prog}: {text}", file=sys.stderr)
        return 2
    app = create_app(engine, config, on_shutdown=on_shutdown)
    server = build_server(app, config, host=args.host, port=args.port, log_level=args.log_level)
    died: list[BaseException] = []
    if hasattr(engine, "on_death"):  # an engine process: its death ends the server

        def on_death(exc: BaseException) -> None:
            died.append(exc)
            server.should_exit = True

        engine.on_death = on_death
    url = f"http://{_url_host(args.host)}:{listener.getsockname()[1]}/"
    if config.ui:
        logging.getLogger(__name__).info("the live page of the cache: %s", url)
    if args.open:
        _open_when_started(server, url, config.ui)
    server.run(sockets=[listener])
    if died:
        print(f"{prog}: {died[0]}", file=sys.stderr)
        return 1
    return 0


def _open_when_started(server: Any, url: str, ui: bool) -> None:
    """Open `url` in a browser once `server` listens (`--open`; `radixkv chat --web`)."""
    if not ui:
        logging.getLogger(__name__).warning("--open: the page is off (--no-ui)")
        return

    def wait_and_open() -> None:
        deadline = time.monotonic() + 600
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.1)
        if server.started:
            print(f"radixkv: the cache's page is at {url}", file=sys.stderr)
            webbrowser.open(url)

    threading.Thread(target=wait_and_open, name="radixkv-open", daemon=True).start()


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def preflight(args: argparse.Namespace) -> socket.socket:
    """What the user typed, checked before the model loads (which takes a while) and before
    torch and transformers are imported: the engine options, the model's folder, the disk
    tier's folder, the server's limits, and the address, bound now (the returned socket, which
    the server then runs on). Raises ValueError / TypeError."""
    check_engine_options(args)
    serve_config(args, "a model")
    return bind_socket(args.host, args.port)


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port` (not yet listening: connections are refused until the
    server runs on it), so that a port in use or a bad host is known before a model loads.
    Raises ValueError naming the address, and --port where it is out of range."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        sock.bind((host, port))
    except (OSError, OverflowError) as exc:
        sock.close()
        reason = getattr(exc, "strerror", None) or exc
        where = f"{_url_host(host)}:{port}"
        raise ValueError(f"cannot listen on {where}: {reason} (another: --port N)") from None
    return sock


def serve_config(args: argparse.Namespace, model_name: str) -> ServeConfig:
    """The ServeConfig of the parsed options. Raises ValueError for a bad limit."""
    limits = {field: getattr(args, field) for _, field, _, _ in _LIMIT_OPTIONS}
    ui = is_loopback(args.host) if args.ui is None else args.ui
    return ServeConfig(
        model_name=model_name,
        max_queued_requests=args.max_queued_requests,
        admin_key=args.admin_key,
        ui=ui,
        ui_hosts=page_hosts(args.host, args.allowed_host),
        **limits,
    )


def page_hosts(host: str, allowed: list[str]) -> tuple[str, ...]:
    """The host names the page answers besides addresses and localhost: `--host` when it is a
    name, this machine's name when it listens on every interface, and `--allowed-host`."""
    names = list(allowed)
    if host in ("0.0.0.0", "::", ""):
        names.append(socket.gethostname())
    else:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            names.append(host)
    return tuple(dict.fromkeys(n for n in names if n.strip()))


def is_loopback(host: str) -> bool:
    """Whether `host` names only this machine (the page is then on by default)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to any interface


# The limits a public server needs (what each answers: the README's "Limits"):
# flag, ServeConfig field, type, help.
_LIMIT_OPTIONS = [
    (
        "--max-body-bytes",
        "max_body_bytes",
        int,
        "larger request bodies get 413 before they are read",
    ),
    ("--max-stops", "max_stops", int, "entries allowed in `stop` and in `stop_token_ids`"),
    ("--max-stop-chars", "max_stop_chars", int, "characters allowed in one stop string"),
    (
        "--read-timeout",
        "read_timeout_s",
        float,
        "seconds for a request's head and body to arrive; a late body gets 408",
    ),
    ("--keep-alive-timeout", "keep_alive_timeout_s", float, "idle connections close after it (s)"),
    (
        "--health-check-timeout",
        "health_check_timeout_s",
        float,
        "seconds /health_generate waits for a token before it answers 503",
    ),
    (
        "--shutdown-timeout",
        "shutdown_timeout_s",
        float,
        "on SIGTERM/SIGINT, seconds the replies in flight may go on before they end with an "
        "error event; a second signal ends them at once",
    ),
    (
        "--grammar-compile-timeout",
        "grammar_compile_timeout_s",
        float,
        "seconds a structured-output grammar may take to compile; a slower one gets 400",
    ),
    ("--max-grammar-compiles", "max_grammar_compiles", int, "grammars compiled at once"),
    (
        "--grammar-cache",
        "grammar_cache_bytes",
        parse_bytes,
        "memory for compiled grammars, e.g. 512MiB; a grammar over a quarter of it gets 400",
    ),
    ("--max-n", "max_n", int, "choices one request may ask for (`n`)"),
]


# ServeConfig fields -> the flags that set them, for error messages
_SERVE_FLAGS = {field: flag for flag, field, _, _ in _LIMIT_OPTIONS} | {
    "max_queued_requests": "--max-queued-requests",
    "admin_key": "--admin-key",
    "ui_hosts": "--allowed-host",
}


def _add_limit_options(parser: argparse.ArgumentParser) -> None:
    limits = parser.add_argument_group("limits")
    for flag, field, kind, text in _LIMIT_OPTIONS:
        default = _default(field)
        limits.add_argument(
            flag,
            dest=field,
            type=kind,
            default=format_bytes(default) if kind is parse_bytes else default,  # parsed back
            help=f"{text} (default %(default)s)",
        )


def _default(field: str) -> Any:
    return {f.name: f.default for f in dataclasses.fields(ServeConfig)}[field]


def _zmq_error() -> type[Exception]:
    """zmq.ZMQError (a `--kv-events` endpoint that cannot bind), or a stand-in without pyzmq."""
    try:
        import zmq
    except ImportError:
        return ValueError
    return zmq.ZMQError


def start_engine(args: argparse.Namespace) -> tuple[Any, list[Callable[[], None]]]:
    """The engine the parsed options describe, and what the server runs after it stops: an
    engine process, started and ready (its services close with it), or with
    `--no-engine-process` an `LLM` of this process and the closing of its services (the
    KV-event publisher of `--kv-events`, the disk tier's save), run after the engine thread
    stops so that the last events of a shutdown still go out. Raises what `LLM` raises, or
    `EngineStartError` carrying the engine process's words."""
    if args.engine_process:
        from radixkv.serve.engine_client import EngineClient

        level = args.log_level.upper()
        return EngineClient.start_process(args.model, engine_settings(args), log_level=level), []
    llm = build_llm(args)
    return llm, engine_services(llm)


def build_llm(args: argparse.Namespace) -> LLM:
    """The engine the parsed options describe, in this process. Raises what `LLM` raises."""
    from radixkv.engine import LLM, freeze_startup_heap

    llm = LLM(args.model, **engine_settings(args))
    freeze_startup_heap()
    return llm


def engine_services(llm: LLM) -> list[Callable[[], None]]:
    """How to close the services that subscribe to an engine of this process
    (`engine_process.shutdown_services`, which an engine process runs itself)."""
    from radixkv.serve.engine_process import shutdown_services

    return shutdown_services(llm)


def _model_name(engine: Any) -> str:
    model = getattr(engine, "model", None)  # an engine process's ServedModel
    return model.text.model_name if hasattr(model, "text") else engine.model_name


def _is_model_error(exc: BaseException) -> bool:
    from radixkv.engine import ModelLoadError

    return isinstance(exc, ModelLoadError)
