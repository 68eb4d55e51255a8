"""The worker endpoints routers call (radixkv/serve/worker_api.py), against a live tiny server.

The schemas are the ones the routers parse: sgl-model-gateway's ServerInfo / ModelInfo structs and
its /get_load reader, vLLM's Tokenize* / Detokenize* / GenerateRequest models. Render is checked
against the prompt the engine really receives for the same request.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import urllib.error
import urllib.request
from typing import Any

import pytest
from serve_helpers import metric, read_metrics, render_chat, user_message, wait_until

pytest.importorskip("fastapi")


def call(
    server: Any, path: str, body: Any = None, method: str | None = None, key: str | None = None
) -> tuple[int, Any]:
    """`path` answered: (status, JSON or text). `key`: sent as the admin key."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(
        server.base_url + path,
        data=data,
        method=method or ("GET" if body is None else "POST"),
        headers=headers,
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


ADMIN_KEY = "test-admin-key"


@pytest.fixture(scope="module")
def admin_server(make_server: Any) -> Any:
    return make_server(admin_key=ADMIN_KEY)


def test_flush_cache_resets_an_idle_cache_and_refuses_while_requests_run(admin_server: Any) -> None:
    server = admin_server
    client = server.client()
    client.chat.completions.create(model="tiny", messages=chat(2), max_tokens=4)
    assert server.on_engine(lambda llm: llm.cache.stats().num_evictable_blocks) > 0

    stream = client.chat.completions.create(
        model="tiny", messages=chat(3), max_tokens=200, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    wait_until(lambda: call(server, "/get_load")[1][0]["num_tokens"] > 0, what="it runs")
    status, text = call(server, "/flush_cache", method="POST", key=ADMIN_KEY)
    assert status == 400  # SGLang's answer while requests are running or waiting
    assert "1 requests running" in text
    assert server.on_engine(lambda llm: llm.cache.stats().num_evictable_blocks) > 0
    stream.close()

    def flushed() -> bool:
        return call(server, "/flush_cache", method="POST", key=ADMIN_KEY)[0] == 200

    wait_until(flushed, what="the flush once the stream is aborted")
    stats = server.on_engine(lambda llm: llm.cache.stats())
    assert stats.num_evictable_blocks == 0 and stats.num_in_use_blocks == 0
    server.on_engine(lambda llm: llm.check_integrity())
    reply = client.chat.completions.create(model="tiny", messages=chat(2), max_tokens=4)
    assert reply.usage.prompt_tokens_details.cached_tokens == 0  # it was really dropped


def cached_blocks(server: Any) -> int:
    return server.on_engine(lambda llm: llm.cache.stats().num_evictable_blocks)


def test_flush_cache_is_off_without_an_admin_key_and_never_answers_get(
    server: Any, admin_server: Any
) -> None:
    for s in (server, admin_server):
        s.client().chat.completions.create(model="tiny", messages=chat(7), max_tokens=2)
    before = cached_blocks(server)
    assert before > 0
    status, body = call(server, "/flush_cache", method="POST")
    assert status == 403 and "--admin-key" in body["error"]["message"]
    status, _ = call(server, "/flush_cache", method="POST", key="anything")
    assert status == 403
    assert call(server, "/flush_cache")[0] == 405  # a GET: what an <img src> sends
    assert cached_blocks(server) == before

    kept = cached_blocks(admin_server)
    for key in (None, "wrong", ADMIN_KEY + "x"):
        status, body = call(admin_server, "/flush_cache", method="POST", key=key)
        assert status == 401 and body["error"]["code"] == "invalid_api_key", key
    assert call(admin_server, "/flush_cache", key=ADMIN_KEY)[0] == 405
    assert cached_blocks(admin_server) == kept
    assert call(admin_server, "/flush_cache", method="POST", key=ADMIN_KEY)[0] == 200
    assert cached_blocks(admin_server) == 0


def test_flush_cache_clears_the_disk_tier_or_keeps_it_and_says_which(
    make_server: Any, tmp_path: Any
) -> None:
    from radixkv.cache.events import AllBlocksCleared, BlockRemoved

    events: list[Any] = []
    tiers = {"block_size": 4, "host_cache_bytes": 64 * 2**10, "kv_cache_dir": str(tmp_path)}
    server = make_server({**tiers, "kv_events": events.append}, admin_key=ADMIN_KEY)
    client = server.client()
    prompt = user_message(11, 24)

    def disk_removals() -> list[Any]:
        """The disk tier's removals since the last cache clearing announced (events drain
        after a step)."""
        last = max(i for i, e in enumerate(events) if isinstance(e, AllBlocksCleared))
        return [e for e in events[last:] if isinstance(e, BlockRemoved) and e.medium == "DISK"]

    def cached_tokens() -> int:
        reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
        return reply.usage.prompt_tokens_details.cached_tokens

    def block_files() -> list[Any]:
        return [p for p in tmp_path.rglob("*") if p.is_file() and p.name != "fingerprint.json"]

    cached_tokens()
    server.on_engine(lambda llm: llm.save_kv_cache())
    assert block_files()
    status, text = call(server, "/flush_cache", {"keep_disk": True}, key=ADMIN_KEY)
    assert status == 200 and "disk tier kept" in text, text
    assert cached_tokens() > 0  # served from the disk tier, the only one left
    assert disk_removals() == []
    server.on_engine(lambda llm: llm.check_integrity())

    status, text = call(server, "/flush_cache", method="POST", key=ADMIN_KEY)
    assert status == 200 and "disk tier's files included" in text, text
    assert block_files() == []
    assert cached_tokens() == 0
    assert disk_removals()  # the events say the disk's blocks went too
    server.on_engine(lambda llm: llm.check_integrity())
    status, body = call(server, "/flush_cache", {"keep_disk": "yes"}, key=ADMIN_KEY)
    assert status == 400 and body["error"]["param"] == "keep_disk"


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


def test_tokenize_has_the_completion_routes_caps_and_checks_them_before_tokenizing(
    server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Any] = []
    monkeypatch.setattr(server.llm, "encode", lambda text: calls.append(text))
    monkeypatch.setattr(server.llm, "encode_chat", lambda messages: calls.append(messages))
    long_text = "w12 " * 20_000  # 80,000 characters: more than any 1,024 tokens of the vocabulary
    status, out = call(server, "/tokenize", {"prompt": long_text})
    assert status == 400 and out["error"]["param"] == "prompt"
    status, out = call(server, "/tokenize", {"messages": [{"role": "user", "content": long_text}]})
    assert status == 400 and out["error"]["param"] == "messages"
    status, out = call(server, "/tokenize", {"prompt": long_text, "add_special_tokens": False})
    assert status == 400 and out["error"]["param"] == "prompt"
    assert calls == []


def test_tokenize_refuses_more_tokens_than_the_context_holds(server: Any) -> None:
    context = server.llm.config.max_model_len
    text = "w12 " * (context + 1)  # short enough to tokenize, one token too many to run
    for body in ({"prompt": text}, {"prompt": text, "add_special_tokens": False}):
        status, out = call(server, "/tokenize", body)
        assert status == 400 and "context length" in out["error"]["message"], out
    status, out = call(server, "/detokenize", {"tokens": [12] * (context + 1)})
    assert status == 400 and out["error"]["param"] == "tokens"


@pytest.mark.parametrize(
    ("path", "body", "name"),
    [
        ("/tokenize", {"prompt": "w10 w11"}, "encode"),
        ("/tokenize", {"messages": [{"role": "user", "content": "w10"}]}, "apply_chat_template"),
        ("/tokenize", {"prompt": "w10", "return_token_strs": True}, "convert_ids_to_tokens"),
        ("/detokenize", {"tokens": [10, 11]}, "decode"),
    ],
)
def test_tokenize_and_detokenize_work_off_the_event_loop(
    server: Any, monkeypatch: pytest.MonkeyPatch, path: str, body: Any, name: str
) -> None:
    target = server.llm.tokenizer  # the server's front end's: the same object in this process
    real = getattr(target, name)
    threads: list[str] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, recording)
    assert call(server, path, body)[0] == 200
    assert threads and all(t.startswith("radixkv-prep") for t in threads), threads


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (rb'{"prompt": "w10 \ud800", "add_special_tokens": false}', "prompt"),
        (rb'{"prompt": "w10 \udc00"}', "prompt"),
        (rb'{"messages": [{"role": "user", "content": "\ud800"}]}', "messages[0].content"),
        (rb'{"tokens": [1], "model": "\ud800"}', "model"),
    ],
)
def test_tokenize_and_detokenize_refuse_a_lone_surrogate_with_400(
    server: Any, raw: bytes, param: str
) -> None:
    path = "/detokenize" if b"tokens" in raw else "/tokenize"
    status, out = post_raw(server, path, raw)
    assert status == 400 and out["error"]["param"] == param, out
    assert "surrogate" in out["error"]["message"]


@pytest.mark.parametrize("tokens", [[True], [1.0], [12, False], ["12"], 12, None])
def test_detokenize_takes_integers_only(server: Any, tokens: Any) -> None:
    status, out = call(server, "/detokenize", {"tokens": tokens})
    assert status == 400 and out["error"]["param"].startswith("tokens"), out


def post_raw(server: Any, path: str, raw: bytes) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", path, body=raw, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    status, data = response.status, json.loads(response.read())
    conn.close()
    return status, data


def test_model_card_by_id(server: Any) -> None:
    status, card = call(server, "/v1/models/tiny")
    assert status == 200 and card["id"] == "tiny" and card["object"] == "model"
    status, out = call(server, "/v1/models/nope")
    assert status == 404 and out["error"]["code"] == "model_not_found"


def concurrently(fn: Any, n: int) -> list[Any]:
    """`n` calls of fn() at once, each in a thread: their results."""
    results: list[Any] = []
    threads = [threading.Thread(target=lambda: results.append(fn())) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_concurrent_health_checks_share_one_probe_that_keeps_the_shared_cache_clean(
    make_server: Any,
) -> None:
    server = make_server()  # no token yet: the checks need a probe
    probe = server.app.state.health_probe
    results = concurrently(lambda: call(server, "/health_generate")[0], 8)
    assert results == [200] * 8
    assert probe.num_probes == 1
    assert call(server, "/get_load")[1][0]["num_reqs"] == 0
    reply = server.client().completions.create(model="tiny", prompt=[0, 0], max_tokens=1)
    assert reply.usage.prompt_tokens_details.cached_tokens == 0  # the probe's [0] is salted
    server.on_engine(lambda llm: llm.check_integrity())


def test_health_generate_answers_from_a_recent_token_without_a_probe(server: Any) -> None:
    probe = server.app.state.health_probe
    stream = server.client().chat.completions.create(
        model="tiny", messages=chat(8), max_tokens=200, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = iter(stream)
    next(chunks)
    next(chunks)  # a token came
    before = probe.num_probes
    assert call(server, "/health_generate") == (200, {"status": "ok"})
    assert probe.num_probes == before
    stream.close()


def block_engine(server: Any) -> threading.Event:
    """Hold the engine thread until the returned event is set."""
    gate, held = threading.Event(), threading.Event()

    def hold(llm: Any) -> None:
        held.set()
        gate.wait(60)

    server.server_state.engine.call(hold)
    assert held.wait(30), "the engine thread never took the command"
    return gate


def test_health_generate_times_out_when_the_engine_never_takes_the_probe(make_server: Any) -> None:
    server = make_server(health_check_timeout_s=1.0, max_queued_requests=4)
    probe = server.app.state.health_probe
    gate = block_engine(server)
    try:
        results = concurrently(lambda: call(server, "/health_generate"), 40)
        assert [status for status, _ in results] == [503] * 40
        assert "no token" in results[0][1]["status"]
        assert probe.num_probes == 1  # one probe for the 40 checks, not 40 requests queued
    finally:
        gate.set()
    wait_until(lambda: call(server, "/get_load")[1][0]["num_reqs"] == 0, what="the probe gone")
    assert call(server, "/health_generate")[0] == 200
    server.on_engine(lambda llm: llm.check_integrity())


def test_health_generate_adds_no_request_to_a_full_queue(make_server: Any) -> None:
    server = make_server(health_check_timeout_s=1.0, max_queued_requests=1)
    probe = server.app.state.health_probe
    gate = block_engine(server)
    result: list[Any] = []
    waiting = threading.Thread(
        target=lambda: result.append(
            server.client().completions.create(model="tiny", prompt="w10 w11", max_tokens=2)
        )
    )
    waiting.start()
    try:
        engine = server.server_state.engine
        wait_until(lambda: engine.num_queued >= 1, what="the request queued")
        assert call(server, "/health_generate")[0] == 503
        assert probe.num_probes == 0
    finally:
        gate.set()
    waiting.join(60)
    assert result and result[0].usage.completion_tokens == 2
    server.on_engine(lambda llm: llm.check_integrity())


def test_health_generate_answers_503_once_the_server_is_shutting_down(make_server: Any) -> None:
    server = make_server()
    probe = server.app.state.health_probe
    server.server_state.begin_shutdown()
    assert call(server, "/health_generate") == (503, {"status": "shutting down"})
    assert probe.num_probes == 0


def test_a_reply_names_the_server_that_served_it(server: Any) -> None:
    """Behind a router a client learns which replica answered from `system_fingerprint`, the
    value that replica's /server_info reports."""
    _, info = call(server, "/server_info")
    reply = server.client().chat.completions.create(model="tiny", messages=chat(1), max_tokens=2)
    assert info["system_fingerprint"].startswith("fp_")
    assert reply.system_fingerprint == info["system_fingerprint"]
