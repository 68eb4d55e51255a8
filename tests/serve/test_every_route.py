"""Every route of the app, present and future, behind the one door: the test reads the routes off
the app itself, so a route added later is covered without a line here.

Each gets an oversized body (413 from the door, before any route runs) and a body with a lone
surrogate (a route that reads a body answers 400 naming the field; a route that reads none
ignores it; none answers 500: a surrogate that reached a tokenizer or a JSON reply would), and
the server keeps serving.
"""

from __future__ import annotations

import http.client
import json
import re
from typing import Any

import pytest
from serve_helpers import metric, read_metrics

fastapi = pytest.importorskip("fastapi")

MAX_BODY_BYTES = 4096
ADMIN_KEY = "every-route-key"


@pytest.fixture(scope="module")
def door_server(make_server: Any) -> Any:
    return make_server(max_body_bytes=MAX_BODY_BYTES, admin_key=ADMIN_KEY)


def app_routes(app: Any) -> list[tuple[str, str]]:
    """(method, path) of each HTTP route of `app`, path parameters filled with the model's id."""
    pairs = []
    for route in app.routes:
        for method in sorted(getattr(route, "methods", None) or ()):
            if method != "HEAD":  # answered as its GET
                pairs.append((method, re.sub(r"\{[^}]*\}", "tiny", route.path)))
    return pairs


def send(port: int, method: str, path: str, body: bytes, **headers: str) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    conn.request(method, path, body=body, headers={"Content-Type": "application/json", **auth})
    response = conn.getresponse()
    status, raw = response.status, response.read()
    conn.close()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def test_the_routes_are_read_off_the_app(door_server: Any) -> None:
    pairs = app_routes(door_server.app)
    for expected in [
        ("POST", "/v1/chat/completions"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("POST", "/flush_cache"),
        ("GET", "/health_generate"),
        ("GET", "/v1/models/tiny"),
    ]:
        assert expected in pairs


def test_every_route_refuses_an_oversized_body_with_413(door_server: Any) -> None:
    before = read_metrics(door_server.base_url)
    pairs = app_routes(door_server.app)
    body = json.dumps({"prompt": "w10 " * MAX_BODY_BYTES}).encode()
    for method, path in pairs:
        status, answer = send(door_server.port, method, path, body)
        assert status == 413, (method, path, answer)
        assert answer["error"]["code"] == "request_too_large"
    after = read_metrics(door_server.base_url)
    refused = metric(after, "radixkv_requests_total", outcome="bad_request")
    assert refused == len(pairs) + metric(before, "radixkv_requests_total", outcome="bad_request")


def test_every_route_answers_a_lone_surrogate_without_a_500(door_server: Any) -> None:
    body = rb'{"model": "tiny", "prompt": "w10 \ud800", "messages": [], "tokens": [1]}'
    reads_a_body = []
    for method, path in app_routes(door_server.app):
        status, answer = send(door_server.port, method, path, body)
        assert status < 500, (method, path, answer)
        if status == 400:  # read through the door's parser, which names the field
            assert answer["error"]["param"] == "prompt", (method, path, answer)
            assert "surrogate" in answer["error"]["message"]
            reads_a_body.append(path)
    assert {"/v1/completions", "/tokenize", "/detokenize", "/flush_cache"} <= set(reads_a_body)
    assert send(door_server.port, "GET", "/health", b"")[0] == 200
    door_server.on_engine(lambda llm: llm.check_integrity())


def test_a_route_added_later_reading_its_body_the_usual_way_gets_it_within_the_limit(
    door_server: Any,
) -> None:
    @door_server.app.post("/test-only/body-length")
    async def body_length(request: fastapi.Request) -> dict[str, int]:
        return {"length": len(await request.body())}

    try:
        assert send(door_server.port, "POST", "/test-only/body-length", b"x" * 1000) == (
            200,
            {"length": 1000},
        )
        status, _ = send(door_server.port, "POST", "/test-only/body-length", b"x" * 5000)
        assert status == 413
    finally:
        door_server.app.router.routes.pop()
