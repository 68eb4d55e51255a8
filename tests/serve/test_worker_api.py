"""The worker endpoints routers call (radixkv/serve/worker_api.py), against a live tiny server.

The schemas are the ones the routers parse: sgl-model-gateway's ServerInfo / ModelInfo structs and
its /get_load reader, vLLM's Tokenize* / Detokenize* / GenerateRequest models. Render is checked
against the prompt the engine really receives for the same request.
"""

from __future__ import annotations

import json
import os
import threading
import urllib.error
import urllib.request
from typing import Any

import pytest
from serve_helpers import metric, read_metrics, render_chat, user_message, wait_until

pytest.importorskip("fastapi")


def call(server: Any, path: str, body: Any = None, method: str | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        server.base_url + path,
        data=data,
        method=method or ("GET" if body is None else "POST"),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


@pytest.fixture
def submitted(server: Any, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The prompt ids of every request the server hands to its engine thread."""
    engine = server.server_state.engine
    seen: list[list[int]] = []
    original = engine.submit

    async def recording(prompt_ids: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(list(prompt_ids))
        return await original(prompt_ids, *args, **kwargs)

    monkeypatch.setattr(engine, "submit", recording)
    return seen


def chat(seed: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": user_message(100 + seed, 4)},
        {"role": "user", "content": user_message(seed)},
    ]


# ---------------------------------------------------------------------------------- SGLang
@pytest.mark.parametrize("path", ["/server_info", "/get_server_info"])
def test_server_info_has_what_sglang_router_reads(server: Any, path: str) -> None:
    status, info = call(server, path)
    assert status == 200
    # sgl-model-gateway's ServerInfo: every field optional, but typed (a wrong type fails it all)
    assert info["served_model_name"] == "tiny"
    assert isinstance(info["model_path"], str) and info["model_path"]
    assert info["dp_size"] == 1
    cache = server.llm.cache
    assert info["max_total_tokens"] == cache.num_blocks * cache.block_size
    for name in ("max_prefill_tokens", "max_running_requests", "page_size", "context_length"):
        assert isinstance(info[name], int) and info[name] > 0, name
    assert isinstance(info["version"], str)
    assert_local_tokenizer(info["tokenizer_path"])


@pytest.mark.parametrize("path", ["/model_info", "/get_model_info"])
def test_model_info_has_what_sglang_router_reads(server: Any, path: str) -> None:
    status, info = call(server, path)
    assert status == 200
    assert info["is_generation"] is True
    assert info["model_type"] == "llama"
    assert info["architectures"] == ["LlamaForCausalLM"]
    assert isinstance(info["model_path"], str)
    assert_local_tokenizer(info["tokenizer_path"])


def assert_local_tokenizer(path: str) -> None:
    """sglang-router downloads a tokenizer_path it cannot find on disk: a replica reports the
    folder it read its tokenizer from."""
    assert os.path.isabs(path) and os.path.isfile(os.path.join(path, "tokenizer.json")), path


def test_get_load_is_sglangs_list_per_rank_and_counts_a_running_request(server: Any) -> None:
    status, idle = call(server, "/get_load")
    assert status == 200
    assert idle == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]

    client = server.client()
    stream = client.chat.completions.create(
        model="tiny",
        messages=chat(1),
        max_tokens=200,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))  # the request is queued (the role chunk comes first)
    busy: list[Any] = []

    def running() -> bool:
        busy.append(call(server, "/get_load")[1][0])
        return busy[-1]["num_reqs"] == 1 and busy[-1]["num_waiting_reqs"] == 0

    wait_until(running, what="the request running")
    load = busy[-1]
    assert load["num_tokens"] >= len(render_chat(server.llm.tokenizer, chat(1)))
    assert load["num_tokens"] % server.llm.cache.block_size == 0
    stream.close()
    wait_until(lambda: call(server, "/get_load")[1][0]["num_reqs"] == 0, what="load back to 0")


def test_flush_cache_resets_an_idle_cache_and_refuses_while_requests_run(server: Any) -> None:
    client = server.client()
    client.chat.completions.create(model="tiny", messages=chat(2), max_tokens=4)
    assert server.on_engine(lambda llm: llm.cache.stats().num_evictable_blocks) > 0

    stream = client.chat.completions.create(
        model="tiny", messages=chat(3), max_tokens=200, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    wait_until(lambda: call(server, "/get_load")[1][0]["num_tokens"] > 0, what="it runs")
    status, text = call(server, "/flush_cache", method="POST")
    assert status == 400  # SGLang's answer while requests are running or waiting
    assert "1 requests running" in text
    assert server.on_engine(lambda llm: llm.cache.stats().num_evictable_blocks) > 0
    stream.close()

    def flushed() -> bool:
        return call(server, "/flush_cache", method="POST")[0] == 200

    wait_until(flushed, what="the flush once the stream is aborted")
    stats = server.on_engine(lambda llm: llm.cache.stats())
    assert stats.num_evictable_blocks == 0 and stats.num_in_use_blocks == 0
    server.on_engine(lambda llm: llm.check_integrity())
    reply = client.chat.completions.create(model="tiny", messages=chat(2), max_tokens=4)
    assert reply.usage.prompt_tokens_details.cached_tokens == 0  # it was really dropped


# ------------------------------------------------------------------------------------ vLLM
def test_chat_render_is_the_prompt_generation_runs(server: Any, submitted: list[list[int]]) -> None:
    messages = chat(4)
    renders_before = metric(read_metrics(server.base_url), "radixkv_render_requests_total")
    status, rendered = call(
        server,
        "/v1/chat/completions/render",
        {"model": "tiny", "messages": messages, "max_tokens": 3, "cache_salt": "t1"},
    )
    assert status == 200
    assert not submitted  # rendering runs nothing
    renders = metric(read_metrics(server.base_url), "radixkv_render_requests_total")
    assert renders == renders_before + 1  # counted: vllm-router asks every worker
    # vLLM's GenerateRequest
    assert rendered["request_id"].startswith("chatcmpl-")
    assert rendered["sampling_params"]["max_tokens"] == 3
    assert rendered["model"] == "tiny" and rendered["cache_salt"] == "t1"
    assert rendered["features"] is None and rendered["stream"] is False

    server.client().chat.completions.create(
        model="tiny", messages=messages, max_tokens=3, extra_body={"cache_salt": "t1"}
    )
    assert submitted == [rendered["token_ids"]]
    assert rendered["token_ids"] == render_chat(server.llm.tokenizer, messages)


def test_completion_render_is_a_list_of_what_generation_runs(
    server: Any, submitted: list[list[int]]
) -> None:
    prompt = user_message(5, 12)
    status, rendered = call(server, "/v1/completions/render", {"model": "tiny", "prompt": prompt})
    assert status == 200
    assert isinstance(rendered, list) and len(rendered) == 1
    assert rendered[0]["request_id"].startswith("cmpl-")
    assert rendered[0]["sampling_params"]["max_tokens"] == 16  # OpenAI's completion default
    server.client().completions.create(model="tiny", prompt=prompt)
    assert submitted == [rendered[0]["token_ids"]]


def test_render_refuses_what_generation_refuses(server: Any) -> None:
    status, body = call(server, "/v1/chat/completions/render", {"model": "x", "messages": chat(1)})
    assert status == 400 and body["error"]["param"] == "model"
    status, body = call(server, "/v1/chat/completions/render", {"messages": []})
    assert status == 400 and body["error"]["param"] == "messages"


def test_tokenize_chat_and_prompt_in_vllms_schema(server: Any) -> None:
    messages = chat(6)
    status, out = call(server, "/tokenize", {"model": "tiny", "messages": messages})
    assert status == 200
    ids = render_chat(server.llm.tokenizer, messages)
    assert out == {
        "count": len(ids),
        "max_model_len": server.llm.config.max_model_len,
        "tokens": ids,
        "token_strs": None,
    }
    # vllm-router's fallback body: continue_final_message=false, no add_generation_prompt
    fallback = {"messages": messages, "continue_final_message": False}
    status, same = call(server, "/tokenize", fallback)
    assert status == 200 and same["tokens"] == ids

    status, out = call(server, "/tokenize", {"prompt": "w10 w11 w12", "return_token_strs": True})
    assert status == 200
    assert out["tokens"] == server.llm.encode("w10 w11 w12")
    assert out["token_strs"] == ["w10", "w11", "w12"]


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"prompt": "w10", "messages": [{"role": "user", "content": "w10"}]},
        {"messages": [{"role": "user", "content": "w10"}], "add_generation_prompt": False},
        {"prompt": "w10", "model": "other"},
    ],
)
def test_tokenize_refuses_what_it_cannot_answer_exactly(server: Any, body: dict) -> None:
    status, out = call(server, "/tokenize", body)
    assert status in (400, 404) and "error" in out


def test_detokenize_round_trips_and_checks_ids(server: Any) -> None:
    ids = server.llm.encode("w20 w21 w22")
    assert call(server, "/detokenize", {"model": "tiny", "tokens": ids}) == (
        200,
        {"prompt": "w20 w21 w22"},
    )
    status, out = call(server, "/detokenize", {"tokens": [1, 10**6]})
    assert status == 400 and out["error"]["param"] == "tokens"


def test_model_card_by_id(server: Any) -> None:
    status, card = call(server, "/v1/models/tiny")
    assert status == 200 and card["id"] == "tiny" and card["object"] == "model"
    status, out = call(server, "/v1/models/nope")
    assert status == 404 and out["error"]["code"] == "model_not_found"


def test_health_generate_runs_one_token_and_keeps_the_shared_cache_clean(server: Any) -> None:
    results: list[int] = []
    threads = [
        threading.Thread(target=lambda: results.append(call(server, "/health_generate")[0]))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [200, 200]
    assert call(server, "/get_load")[1][0]["num_reqs"] == 0
    server.on_engine(lambda llm: llm.check_integrity())


def test_a_reply_names_the_server_that_served_it(server: Any) -> None:
    """Behind a router a client learns which replica answered from `system_fingerprint`, the
    value that replica's /server_info reports."""
    _, info = call(server, "/server_info")
    reply = server.client().chat.completions.create(model="tiny", messages=chat(1), max_tokens=2)
    assert info["system_fingerprint"].startswith("fp_")
    assert reply.system_fingerprint == info["system_fingerprint"]
