"""The live page of the cache: `/` (the page), `/ui/<file>` (its script and style) and
`/ui/events` (its snapshots, as server-sent events). Added by `create_app` only when
`ServeConfig.ui` is on; `cache_view.py` builds what the stream carries.

The files are plain HTML/CSS/JS shipped in the package (`static/`): no build step, nothing
fetched from elsewhere. Their Content-Security-Policy allows scripts, styles and connections
from this server only, and no inline script: a text that slipped into the page as HTML could
still not run.

The page and its stream carry every shared prompt's text, so they answer only requests whose
`Host` names this server (`host_allowed`), as Jupyter does: otherwise a web page the user
visits could rebind its own domain name to 127.0.0.1 (DNS rebinding) and read them as
same-origin. Others get 403.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import AsyncIterator, Collection
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from radixkv.serve.cache_view import CacheView
from radixkv.serve.protocol import APIError

HEARTBEAT_S = 15.0  # an SSE comment this often: a page gone away is noticed by the write
_FILES = {  # name -> media type; nothing else under static/ is served
    "index.html": "text/html; charset=utf-8",
    "page.js": "text/javascript; charset=utf-8",
    "page.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
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
    hosts = server.config.ui_hosts

    @app.get("/")
    async def page(request: Request) -> Response:
        _check_host(request, hosts)
        return _file(files, "index.html")

    @app.get("/ui/events")
    async def events(request: Request) -> Response:
        _check_host(request, hosts)
        queue = view.subscribe()
        return StreamingResponse(
            _stream(view, queue, server), media_type="text/event-stream", headers=_HEADERS
        )

    # after /ui/events, which it would otherwise shadow
    @app.get("/ui/{name}")
    async def asset(name: str, request: Request) -> Response:
        _check_host(request, hosts)
        if name not in _FILES or name == "index.html":
            raise APIError(404, f"Invalid URL (GET /ui/{name})")
        return _file(files, name)

    @app.get("/favicon.ico")
    async def favicon(request: Request) -> Response:
        _check_host(request, hosts)
        return _file(files, "favicon.svg")


def host_allowed(host_header: str, names: Collection[str]) -> bool:
    """Whether a request's `Host` (name or address, and port) names this server: an IP
    address (no domain to rebind), `localhost` or a name under it, or one of `names` (the
    name it listens on, `--allowed-host`); case-insensitive."""
    host = host_header.strip().lower()
    if host.startswith("["):  # an IPv6 literal, [::1]:8000
        return "]" in host and _is_ip(host[1 : host.index("]")])
    name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    name = name.rstrip(".")
    if _is_ip(name) or name == "localhost" or name.endswith(".localhost"):
        return True
    return name in {n.lower().rstrip(".") for n in names}


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _check_host(request: Request, names: Collection[str]) -> None:
    host = request.headers.get("host", "")
    if not host_allowed(host, names):
        raise APIError(
            403,
            f"the page answers only this server's own host names, not {host[:80]!r}; to open it "
            "under that name, start the server with --allowed-host NAME",
            code="host_not_allowed",
        )


def _read(name: str) -> bytes:
    return (resources.files("radixkv.serve") / "static" / name).read_bytes()


def _file(files: dict[str, bytes], name: str) -> Response:
    return Response(files[name], media_type=_FILES[name], headers=_HEADERS)


async def _stream(
    view: CacheView, queue: asyncio.Queue[str | None], server: Any
) -> AsyncIterator[str]:
    """Snapshots as they come, until the page goes, a newer page displaces it or the server
    begins shutting down."""
    stopping = server.stopping
    get: asyncio.Future[str | None] | None = None
    try:
        yield "retry: 2000\n\n"
        while not server.is_stopping:
            get = asyncio.ensure_future(queue.get())
            await asyncio.wait({get, stopping}, timeout=HEARTBEAT_S, return_when="FIRST_COMPLETED")
            if not get.done():
                get.cancel()
                yield ": keep-alive\n\n"
                continue
            text = get.result()
            if text is None:
                return  # displaced by a newer page (see CacheView.subscribe)
            yield f"event: snapshot\ndata: {text}\n\n"
    finally:
        if get is not None:
            get.cancel()  # the page went away while it waited
        view.unsubscribe(queue)
