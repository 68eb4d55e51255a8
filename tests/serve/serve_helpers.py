"""Shared helpers of the server tests: rendering chats, reading /metrics, waiting."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable
from typing import Any

USER_WORDS = [f"w{i}" for i in range(10, 250)]


def user_message(seed: int, n: int = 6) -> str:
    """A deterministic user message of `n` ordinary words of the tiny tokenizer."""
    return " ".join(USER_WORDS[(seed * 7919 + i * 31) % len(USER_WORDS)] for i in range(n))


def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def run_alone(llm: Any, prompt_ids: list[int], max_tokens: int) -> Any:
    """The greedy RequestOutput of one request run by itself."""
    from radixkv.engine.sampling_params import SamplingParams

    (out,) = llm.generate([prompt_ids], SamplingParams(max_tokens=max_tokens))
    return out


def read_metrics(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET /metrics parsed: (sample name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def metric(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def wait_until(condition: Callable[[], bool], timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or condition}")
        time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, port: int) -> None:
    """Until the `radixkv serve` process `proc` answers /health on `port` (it must not exit)."""
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else proc
        assert time.monotonic() < deadline, "the server did not start"
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            time.sleep(0.2)


def post_json(port: int, body: dict, path: str = "/v1/chat/completions") -> tuple[int, dict]:
    """POST `body` as JSON to the server on `port`: (status, the JSON answer)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def chat_request(content: str = "hi", **fields: Any) -> dict:
    """A greedy chat body of one user message; `fields` added or overriding."""
    messages = [{"role": "user", "content": content}]
    return {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0, **fields}
