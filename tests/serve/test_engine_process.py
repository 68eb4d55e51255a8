"""`radixkv serve` with its engine in a process of its own (the default): real server processes on
127.0.0.1 over the tiny model, checked against the engine in-process, through streaming,
structured output, disconnects, the live page, the admin route, shutdown, and an engine that
dies or is orphaned."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serve_helpers import (
    free_port,
    metric,
    post_json,
    read_metrics,
    user_message,
    wait_healthy,
    wait_until,
)

pytest.importorskip("zmq")

ADMIN_KEY = "engine-process-test-key"


class Server:
    def __init__(self, proc: subprocess.Popen, port: int) -> None:
        self.proc, self.port = proc, port
        self.base_url = f"http://127.0.0.1:{port}"

    @property
    def engine_pid(self) -> int:
        (pid,) = engine_children(self.proc.pid)
        return pid


def engine_children(pid: int) -> list[int]:
    """The engine processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[1]) == pid and b"radixkv.serve.engine_process" in cmdline:
            found.append(int(entry.name))
    return found


def start_server(model_dir: Path, *extra: str) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "radixkv", "serve", "--model", str(model_dir), "--port", str(port)]
    cmd += ["--num-blocks", "256", "--log-level", "info", "--admin-key", ADMIN_KEY, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_healthy(proc, port)
    return Server(proc, port)


def stop(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait(30)


@pytest.fixture(scope="module")
def served(tiny_model_dir) -> Iterator[Server]:
    server = start_server(tiny_model_dir("gqa"))
    try:
        yield server
    finally:
        stop(server)


def completion(port: int, prompt: str, max_tokens: int = 6, **fields: Any) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields}
    status, out = post_json(port, body, "/v1/completions")
    assert status == 200, out
    return out


def stream_events(port: int, body: dict, path: str = "/v1/completions") -> list[Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", path, json.dumps({**body, "stream": True}), _JSON)
    events = []
    for line in conn.getresponse():
        if line.startswith(b"data: "):
            data = line[6:].strip().decode()
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


_JSON = {"Content-Type": "application/json"}


def test_the_engine_runs_in_a_process_of_its_own(served: Server) -> None:
    pid = served.engine_pid
    assert pid != served.proc.pid
    samples = read_metrics(served.base_url)
    # the pool of the engine's process, read before any request: its real size
    assert metric(samples, "radixkv_blocks", state="free") == 256
    assert metric(samples, "radixkv_kv_pool_blocks", group="full", layout="kv") == 256


def test_replies_equal_the_engine_in_this_process(served: Server, tiny_model_dir) -> None:
    from radixkv import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir("gqa")), num_blocks=256)
    prompts = [user_message(seed) for seed in range(4)]
    expected = [o.text for o in llm.generate(prompts, SamplingParams(max_tokens=6))]
    assert [completion(served.port, p)["choices"][0]["text"] for p in prompts] == expected
    # streamed: the deltas the front end detokenized add up to the same text
    events = stream_events(served.port, {"prompt": prompts[0], "max_tokens": 6, "temperature": 0})
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == expected[0]
    # and the second time, the prompt's prefix comes from the engine process's cache
    again = completion(served.port, prompts[1])
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_grammar_compiled_by_the_front_end_constrains_the_engine(served: Server) -> None:
    # Compiled in the front end's worker pool, sent as xgrammar's JSON, loaded by the engine.
    choices = ["w12", "w20", "w33"]  # words: the tiny tokenizer spells no spaces
    for seed in range(3):
        body = {"structured_outputs": {"choice": choices}}
        out = completion(served.port, user_message(seed + 20), max_tokens=10, **body)
        assert out["choices"][0]["text"].strip() in choices, out


def test_a_client_that_leaves_aborts_its_request_in_the_engine(served: Server) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    body = {"prompt": user_message(7), "max_tokens": 1000, "stream": True, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps({**body, "temperature": 0}), _JSON)
    response = conn.getresponse()
    assert response.readline().startswith(b"data: ")  # it runs
    samples = read_metrics(served.base_url)
    assert metric(samples, "radixkv_running_requests") == 1
    conn.close()

    def idle() -> bool:
        samples = read_metrics(served.base_url)
        return metric(samples, "radixkv_running_requests") == 0

    wait_until(idle, 30, "the engine process to abort the request")


def test_the_live_page_and_the_admin_route_reach_the_engine(served: Server) -> None:
    completion(served.port, user_message(11))
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    conn.request("GET", "/ui/events", headers={"Host": f"127.0.0.1:{served.port}"})
    response = conn.getresponse()
    assert response.status == 200
    data = next(line for line in response if line.startswith(b"data: "))
    snapshot = json.loads(data[6:])
    assert len(snapshot["tree"]["nodes"]) > 1  # the engine's tree, captured there
    conn.close()
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    headers = {**_JSON, "Authorization": f"Bearer {ADMIN_KEY}"}
    conn.request("POST", "/flush_cache", "{}", headers)
    response = conn.getresponse()
    assert response.status == 200, response.read()
    response.read()
    samples = read_metrics(served.base_url)
    assert metric(samples, "radixkv_blocks", state="evictable") == 0


def test_sigterm_stops_the_engine_process_with_the_server(tiny_model_dir) -> None:
    server = start_server(tiny_model_dir("gqa"))
    try:
        engine = server.engine_pid
        completion(server.port, user_message(13))
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
        wait_until(lambda: not Path(f"/proc/{engine}").exists(), 10, "the engine process to end")
    finally:
        stop(server)
    log = server.proc.stderr.read().decode()
    assert "engine process stopped" in log


def test_an_engine_that_dies_fails_its_requests_and_ends_the_server(tiny_model_dir) -> None:
    server = start_server(tiny_model_dir("gqa"))
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        body = {"prompt": user_message(17), "max_tokens": 1000, "stream": True}
        body |= {"ignore_eos": True, "temperature": 0}
        conn.request("POST", "/v1/completions", json.dumps(body), _JSON)
        response = conn.getresponse()
        assert response.readline().startswith(b"data: ")
        os.kill(server.engine_pid, signal.SIGKILL)
        events = [line[6:].strip() for line in response if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]"
        error = json.loads(events[-2])["error"]
        assert "EngineDead" in error["message"], error
        assert server.proc.wait(30) == 1  # reported, not hung on
    finally:
        stop(server)
    log = server.proc.stderr.read().decode()
    assert log.rstrip().splitlines()[-1].startswith("radixkv serve: the engine process exited")


def test_an_orphaned_engine_process_exits(tiny_model_dir) -> None:
    server = start_server(tiny_model_dir("gqa"))
    engine = server.engine_pid
    try:
        server.proc.kill()  # no shutdown at all: the engine notices its parent is gone
        server.proc.wait(30)
        wait_until(lambda: not _alive(engine), 15, "the orphaned engine process to exit")
    finally:
        stop(server)
        if _alive(engine):
            os.kill(engine, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
