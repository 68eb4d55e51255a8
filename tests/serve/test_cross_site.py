"""What a web page the user visits can make the server do (issue 43, items 5 and 6), against a
live server on 127.0.0.1: the live page and its stream answer only this server's own host names
(DNS rebinding), and a body that is not declared JSON runs nothing (a "simple" cross-origin
request). Hostile requests come in bounded rounds."""

from __future__ import annotations

import http.client
import json

import pytest
from serve_helpers import metric, read_metrics

from radixkv.serve.ui_routes import host_allowed

CHAT = "/v1/chat/completions"
PAGE_PATHS = ("/", "/ui/events", "/ui/page.js", "/ui/page.css", "/favicon.ico")


@pytest.fixture(scope="module")
def server(make_server):
    return make_server(ui=True, ui_hosts=("mybox.lan",))


def request(port: int, method: str, path: str, body: bytes | None = None, **headers: str):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.putrequest(method, path, skip_host="Host" in headers)
    for name, value in headers.items():
        conn.putheader(name.replace("_", "-"), value)
    if body is not None:
        conn.putheader("Content-Length", str(len(body)))
    conn.endheaders(body)
    response = conn.getresponse()
    # an event stream never ends: its first line is enough
    data = response.readline() if path == "/ui/events" else response.read()
    conn.close()
    return response.status, response.getheader("Content-Type") or "", data


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        ("127.0.0.1:8000", True),
        ("[::1]:8000", True),
        ("localhost:8000", True),
        ("LocalHost", True),
        ("app.localhost:8000", True),
        ("10.1.2.3", True),
        ("mybox.lan:8000", True),
        ("MYBOX.LAN.", True),
        ("attacker.example:8000", False),
        ("127.0.0.1.attacker.example", False),
        ("localhost.attacker.example:8000", False),
        ("", False),
        ("[::1", False),
    ],
)
def test_the_page_answers_only_its_own_host_names(host: str, allowed: bool) -> None:
    assert host_allowed(host, ("mybox.lan",)) is allowed


def test_a_rebound_host_name_reads_neither_the_page_nor_its_stream(server) -> None:
    """Item 5: before, every Host got the page and the stream of the tree's text."""
    for round_ in range(2):
        for path in PAGE_PATHS:
            status, _, body = request(server.port, "GET", path, Host=f"rebind{round_}.example")
            assert status == 403, (path, body)
            error = json.loads(body)["error"]
            assert error["code"] == "host_not_allowed" and "--allowed-host" in error["message"]
    for host in (f"127.0.0.1:{server.port}", f"localhost:{server.port}", "mybox.lan"):
        for path in PAGE_PATHS:
            status, _, body = request(server.port, "GET", path, Host=host)
            assert status == 200, (host, path, body)
    assert server.app.state.cache_view.num_subscribers <= 16


def test_the_favicon_is_served_and_no_refusal_is_counted(server) -> None:
    before = metric(read_metrics(server.base_url), "radixkv_requests_total", outcome="bad_request")
    status, _, page = request(server.port, "GET", "/")
    assert status == 200 and b'rel="icon" href="/ui/favicon.svg"' in page
    for path in ("/ui/favicon.svg", "/favicon.ico"):
        status, kind, body = request(server.port, "GET", path)
        assert status == 200 and kind == "image/svg+xml" and body.startswith(b"<svg")
    after = metric(read_metrics(server.base_url), "radixkv_requests_total", outcome="bad_request")
    assert after == before


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        ("text/plain", None),
        ("text/plain;charset=UTF-8", None),
        ("application/x-www-form-urlencoded", b"model=tiny&messages=x"),
        ("multipart/form-data; boundary=x", b"--x\r\n\r\n{}\r\n--x--\r\n"),
        (None, None),
    ],
)
def test_a_body_not_declared_json_runs_nothing(server, content_type, body) -> None:
    """Item 6: a web page may send any site text/plain, a form or multipart without a
    preflight; before, such a body holding JSON ran a completion. Three rounds: each 415,
    no request reaches the engine."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    raw = body if body is not None else json.dumps(chat).encode()
    headers = {} if content_type is None else {"Content_Type": content_type}
    before = read_metrics(server.base_url)
    for _ in range(3):
        status, _, answer = request(server.port, "POST", CHAT, raw, **headers)
        assert status == 415, answer
        assert json.loads(answer)["error"]["code"] == "unsupported_media_type"
    after = read_metrics(server.base_url)
    for outcome in ("stop", "length"):
        name = "radixkv_requests_total"
        assert metric(after, name, outcome=outcome) == metric(before, name, outcome=outcome)
    assert metric(after, "radixkv_prompt_tokens_total") == metric(
        before, "radixkv_prompt_tokens_total"
    )


@pytest.mark.parametrize("content_type", ["application/json", "Application/JSON; charset=utf-8"])
def test_a_json_body_is_served(server, content_type) -> None:
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, _, answer = request(
        server.port, "POST", CHAT, json.dumps(chat).encode(), Content_Type=content_type
    )
    assert status == 200, answer
    assert json.loads(answer)["usage"]["completion_tokens"] == 2
