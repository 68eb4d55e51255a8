"""uvicorn around the app, with the connection rules and the shutdown a public server needs.

Connections (`_TimedH11Protocol`, uvicorn's h11 protocol plus two timers):
  - an idle connection (open, or done with a response, and sending nothing) is closed after
    `keep_alive_timeout_s` (uvicorn arms this only after a response, never on a new connection);
  - a request's head must be in within `read_timeout_s` of the connection being ready for it;
    else the connection is closed (a body is the door's: it answers 408, see `door.py`);
  - a request line or headers h11 cannot parse get a 400 in OpenAI's error shape;
  - a connection that opens with HTTP/2's preface is closed unanswered: routers probe whether a
    worker speaks HTTP/2 (or gRPC) this way, and h11 would read the preface as a request
    `PRI *` (a 404, counted as a refused request) and its second half as garbage;
  - TCP_NODELAY on every connection (see `connection_made`).

Shutdown (`ServingServer`), on SIGTERM or SIGINT:
  1. stop accepting connections, close idle ones; new requests and bodies still arriving get 503
     and /health answers 503;
  2. replies in flight go on until `shutdown_timeout_s` after the signal;
  3. then each ends with an error: a stream with an error event and `data: [DONE]`, a whole
     reply with a 503; a second signal skips to this step at once;
  4. the lifespan's shutdown: the engine thread stops, then the shutdown hooks run (the
     KV-event publisher closes).
Nothing is cut without an error event, and the engine and its services always stop in order.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from functools import partial
from types import FrameType
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from radixkv.serve.config import ServeConfig
from radixkv.serve.protocol import APIError

logger = logging.getLogger(__name__)

_FLUSH_S = 5.0  # after replies were ended: time for their last bytes before tasks are cancelled
_POLL_S = 0.05
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n"


def build_server(
    app: Any, config: ServeConfig, *, host: str = "127.0.0.1", port: int = 8000, **uvicorn_kw: Any
) -> ServingServer:
    """A server for `create_app(llm, config)`; `.run()` serves until a signal (main thread) or
    `.should_exit = True`; `.run(sockets=[sock])` serves on a bound socket."""
    uv_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=partial(_TimedH11Protocol, read_timeout_s=config.read_timeout_s),  # type: ignore[arg-type]
        timeout_keep_alive=config.keep_alive_timeout_s,  # type: ignore[arg-type]
        lifespan="on",
        **uvicorn_kw,
    )
    return ServingServer(uv_config, app.state.server, config.shutdown_timeout_s)


class ServingServer(uvicorn.Server):
    """uvicorn's server with the shutdown of the module docstring. `api_server` is the app's
    `OpenAIServer`."""

    def __init__(self, config: uvicorn.Config, api_server: Any, shutdown_timeout_s: float) -> None:
        super().__init__(config)
        self.api_server = api_server
        self.shutdown_timeout_s = shutdown_timeout_s
        self._deadline: float | None = None  # monotonic time when replies in flight are ended

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Signal handler (main thread): the first signal starts the shutdown, the next ends
        the replies in flight at once. Unlike uvicorn's, it never skips the lifespan shutdown
        and does not re-raise the signal afterwards: a drained server exits with status 0."""
        if self.should_exit:
            logger.info("%s again: ending the replies in flight now", signal.Signals(sig).name)
            self._deadline = time.monotonic()
            return
        logger.info(
            "%s: shutting down, replies in flight have %g s",
            signal.Signals(sig).name,
            self.shutdown_timeout_s,
        )
        self._deadline = time.monotonic() + self.shutdown_timeout_s
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._deadline is None:  # asked by code (should_exit), not by a signal
            self._deadline = time.monotonic() + self.shutdown_timeout_s
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        self.api_server.begin_shutdown()
        for connection in list(self.server_state.connections):
            connection.shutdown()  # idle: closed now; busy: closed after its response
        tasks = self.server_state.tasks
        while tasks and time.monotonic() < self._deadline:
            await asyncio.sleep(_POLL_S)  # the deadline moves up when a second signal comes
        if tasks:
            logger.info("ending %d request(s) still in flight", len(tasks))
            self.api_server.end_all()
            flush_until = time.monotonic() + _FLUSH_S
            while tasks and time.monotonic() < flush_until:
                await asyncio.sleep(_POLL_S)
            for task in list(tasks):
                task.cancel()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        await self.lifespan.shutdown()


class _TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the idle and head timers of the module docstring."""

    def __init__(self, *args: Any, read_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timeout_s = read_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None
        self._opened = False  # whether any byte came on this connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # asyncio sets this only for listening sockets made with proto=IPPROTO_TCP; a socket
            # handed over (run(sockets=...)) would otherwise hold a response's body back for
            # the client's delayed ACK of its head: 40 ms per request.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )
        self._expect_head()

    def data_received(self, data: bytes) -> None:
        first, self._opened = not self._opened, True
        if first and data.startswith(_HTTP2_PREFACE):
            logger.debug("an HTTP/2 connection preface: closed (this server speaks HTTP/1.1)")
            self.transport.close()
            return
        super().data_received(data)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._expect_head()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _expect_head(self) -> None:
        """The next request's head must come within the read timeout; a new request cycle (a
        new `self.cycle`) is the sign it came."""
        if self._head_timer is not None:
            self._head_timer.cancel()
        waiting_since = self.cycle
        self._head_timer = self.loop.call_later(
            self._read_timeout_s, self._head_timeout, waiting_since
        )

    def _head_timeout(self, waiting_since: Any) -> None:
        if self.cycle is waiting_since and not self.transport.is_closing():
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse: 400 in OpenAI's error shape, then close."""
        body = APIError(400, f"invalid HTTP request: {msg}").body_bytes()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        for event in (
            h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
        self.transport.close()
