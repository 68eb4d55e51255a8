"""The door: an ASGI middleware every HTTP request passes before any route runs.

- It stamps when a request's head arrived and when its whole body had (the server's overhead
  is counted from the second: a client may send its body in a later write than its headers).
- It reads the body under the server's limits, so that no route ever waits on a client:
  over `max_body_bytes` -> 413, at once when Content-Length says so, else as soon as the count
  passes it (the rest is discarded as it arrives, so the client reads the answer); not all in
  within `read_timeout_s` of the head -> 408; the server began shutting down meanwhile -> 503.
  The last two close the connection. The route finds the body in `scope["radixkv.body"]`, and
  reading it from the request (`await request.body()`) gives the same bytes.
- A request with a body must say it is JSON (`Content-Type: application/json`): else 415. A
  web page may send any site a "simple" cross-origin request (text/plain or a form, no
  preflight) that its browser never lets it read the answer of, but that would still run: a
  completion spending the server's compute.
- It answers any exception a route lets through with a 500 in OpenAI's error shape, counted in
  /metrics, and the connection stays usable (Starlette alone would answer in plain text and
  uvicorn would then drop the connection).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from radixkv.serve.protocol import APIError, shutting_down

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class RequestDoor:
    """See the module docstring. `server` is the app's `OpenAIServer` (limits, metrics and the
    future that is done once the server is shutting down)."""

    def __init__(self, app: Any, server: Any) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t_head = time.perf_counter()
        scope["radixkv.t_arrival"] = t_head
        try:
            body = await self._read_body(scope, receive, t_head)
            if body and not _is_json(scope):
                raise _not_json(scope)
        except APIError as exc:
            await send_error(send, exc, self.server.metrics)
            return
        scope["radixkv.t_received"] = time.perf_counter()
        scope["radixkv.body"] = body
        started = False

        async def send_tracked(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, _replaying(body, receive), send_tracked)
        except Exception:
            if started:  # a response broken half-way: only closing the connection tells
                raise
            logger.exception("unhandled error in %s %s", scope["method"], scope["path"])
            error = APIError(500, "internal server error (see the server log)", type="server_error")
            await send_error(send, error, self.server.metrics)

    async def _read_body(self, scope: Scope, receive: Receive, t_head: float) -> bytes:
        headers = dict(scope["headers"])
        limit = self.server.config.max_body_bytes
        declared = headers.get(b"content-length")
        if declared is None and b"transfer-encoding" not in headers:
            return b""  # no body
        if declared is not None and int(declared) > limit:
            raise _too_large(int(declared), limit)
        deadline = t_head + self.server.config.read_timeout_s
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await self._next_message(receive, deadline)
            if message["type"] == "http.disconnect":
                raise APIError(400, "the client closed the connection during its request")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _next_message(self, receive: Receive, deadline: float) -> dict[str, Any]:
        """The next ASGI message of the request, or APIError 408 at `deadline` / 503 when the
        server starts shutting down first."""
        message = asyncio.ensure_future(receive())
        stopping = self.server.stopping
        timeout = max(0.0, deadline - time.perf_counter())
        done, _ = await asyncio.wait(
            {message, stopping}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        if message in done:
            return message.result()
        message.cancel()
        if stopping in done:
            raise shutting_down()
        raise APIError(
            408,
            f"the request did not arrive within {self.server.config.read_timeout_s:g} s",
            headers={"Connection": "close"},
        )


def _replaying(body: bytes, receive: Receive) -> Receive:
    """`receive` for the app: the body the door read, as one message, then the connection's own
    messages (a disconnect). A route that reads its body the usual way (`await request.body()`)
    gets it at once, within the door's limits, instead of waiting on a body already taken."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> dict[str, Any]:
        return pending.pop() if pending else await receive()

    return replay


async def send_error(send: Send, exc: APIError, metrics: Any) -> None:
    """Answer with `exc` in OpenAI's error shape (raw ASGI) and count it in /metrics."""
    metrics.record_refusal(exc)
    body = exc.body_bytes()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *((k.lower().encode(), v.encode()) for k, v in exc.headers.items()),
    ]
    await send({"type": "http.response.start", "status": exc.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _is_json(scope: Scope) -> bool:
    """Whether the request's Content-Type is application/json (parameters such as charset
    aside)."""
    declared = dict(scope["headers"]).get(b"content-type", b"")
    return declared.split(b";", 1)[0].strip().lower() == b"application/json"


def _not_json(scope: Scope) -> APIError:
    declared = dict(scope["headers"]).get(b"content-type", b"(none)").decode("latin-1")
    return APIError(
        415,
        f"the request body must be JSON, sent with Content-Type: application/json (got "
        f"{declared[:60]!r})",
        code="unsupported_media_type",
    )


def _too_large(num_bytes: int, limit: int) -> APIError:
    return APIError(
        413,
        f"the request body has {num_bytes} bytes (or more); at most {limit} are allowed",
        code="request_too_large",
    )
