"""The live page of the cache: `/` (the page), `/ui/<file>` (its script and style) and
`/ui/events` (its snapshots, as server-sent events). Added by `create_app` only when
`ServeConfig.ui` is on; `cache_view.py` builds what the stream carries.

The files are plain HTML/CSS/JS shipped in the package (`static/`): no build step, nothing
fetched from elsewhere. Their Content-Security-Policy allows scripts, styles and connections
from this server only, and no inline script: a text that slipped into the page as HTML could
still not run.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response, StreamingResponse

from radixkv.serve.cache_view import CacheView
from radixkv.serve.protocol import APIError

HEARTBEAT_S = 15.0  # an SSE comment this often: a page gone away is noticed by the write
_FILES = {  # name -> media type; nothing else under static/ is served
    "index.html": "text/html; charset=utf-8",
    "page.js": "text/javascript; charset=utf-8",
    "page.css": "text/css; charset=utf-8",
}
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def add_ui_routes(app: FastAPI, server: Any) -> None:
    """Register the page's routes on `app`; `server` is its OpenAIServer."""
    view = CacheView(server)
    app.state.cache_view = view
    files = {name: _read(name) for name in _FILES}

    @app.get("/")
    async def page() -> Response:
        return _file(files, "index.html")

    @app.get("/ui/events")
    async def events() -> Response:
        queue = view.subscribe()
        if queue is None:
            raise APIError(503, "too many pages are open", type="server_overloaded")
        return StreamingResponse(
            _stream(view, queue, server), media_type="text/event-stream", headers=_HEADERS
        )

    # after /ui/events, which it would otherwise shadow
    @app.get("/ui/{name}")
    async def asset(name: str) -> Response:
        if name not in _FILES or name == "index.html":
            raise APIError(404, f"Invalid URL (GET /ui/{name})")
        return _file(files, name)


def _read(name: str) -> bytes:
    return (resources.files("radixkv.serve") / "static" / name).read_bytes()


def _file(files: dict[str, bytes], name: str) -> Response:
    return Response(files[name], media_type=_FILES[name], headers=_HEADERS)


async def _stream(view: CacheView, queue: asyncio.Queue[str], server: Any) -> AsyncIterator[str]:
    """Snapshots as they come, until the page goes or the server begins shutting down."""
    stopping = server.stopping
    get: asyncio.Future[str] | None = None
    try:
        yield "retry: 2000\n\n"
        while not server.is_stopping:
            get = asyncio.ensure_future(queue.get())
            await asyncio.wait({get, stopping}, timeout=HEARTBEAT_S, return_when="FIRST_COMPLETED")
            if not get.done():
                get.cancel()
                yield ": keep-alive\n\n"
                continue
            yield f"event: snapshot\ndata: {get.result()}\n\n"
    finally:
        if get is not None:
            get.cancel()  # the page went away while it waited
        view.unsubscribe(queue)
