"""`radixkv serve` end to end: the official OpenAI client against a live server on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from contextlib import contextmanager

import pytest
from serve_helpers import (
    metric,
    post_json,
    read_metrics,
    render_chat,
    run_alone,
    user_message,
    wait_until,
)

openai = pytest.importorskip("openai")  # a test extra: absent on the GPU machine

MAX_TOKENS = 6
GREEDY_5 = {"max_tokens": 5, "temperature": 0}


def chat(client, messages, **kwargs):
    return client.chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_tokens=MAX_TOKENS, **kwargs
    )


def start_long_stream(client, seed: int):
    """A streamed reply of 900 tokens: it runs until its client closes it."""
    return client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": user_message(seed)}],
        max_tokens=900,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )


def test_models_and_health(server) -> None:
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with urllib.request.urlopen(f"{server.base_url}/health", timeout=10) as response:
        assert response.status == 200
        assert json.loads(response.read()) == {"status": "ok"}


def test_chat_reply_equals_the_request_run_alone(server, reference_llm) -> None:
    messages = [{"role": "system", "content": "w7 w8"}, {"role": "user", "content": "w20 w21"}]
    reply = chat(server.client(), messages)
    prompt = render_chat(reference_llm.tokenizer, messages)
    alone = run_alone(reference_llm, prompt, MAX_TOKENS)
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == alone.text
    assert choice.finish_reason == alone.finish_reason
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == len(alone.token_ids)
    assert reply.usage.total_tokens == len(prompt) + len(alone.token_ids)


def test_chat_stream_equals_non_stream_and_ends_with_usage(server) -> None:
    messages = [{"role": "user", "content": user_message(1)}]
    client = server.client()
    whole = chat(client, messages)
    chunks = list(chat(client, messages, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason
    assert all(f is None for f in finishes[:-1])
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    # The second identical request found the first one's prompt in the cache.
    assert last.usage.prompt_tokens_details.cached_tokens >= whole.usage.prompt_tokens - 1


def test_completions_text_and_token_ids_stream_and_not(server, reference_llm) -> None:
    client = server.client()
    ids = reference_llm.encode("w30 w31 w32")
    alone = run_alone(reference_llm, ids, 5)
    by_text = client.completions.create(model="tiny", prompt="w30 w31 w32", **GREEDY_5)
    by_ids = client.completions.create(model="tiny", prompt=ids, **GREEDY_5)
    assert by_text.choices[0].text == by_ids.choices[0].text == alone.text
    assert by_ids.usage.prompt_tokens == len(ids)
    streamed = client.completions.create(model="tiny", prompt=ids, **GREEDY_5, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == alone.text


def test_three_turns_report_the_previous_turn_as_cached(server) -> None:
    client = server.client()
    messages = [{"role": "system", "content": "w9 w10 w11"}]
    previous_prompt = 0
    for turn in range(3):
        messages.append({"role": "user", "content": user_message(100 + turn)})
        reply = chat(client, messages)
        cached = reply.usage.prompt_tokens_details.cached_tokens
        if turn == 0:
            assert cached < 4  # at most the role marker other conversations share
        else:
            assert cached >= previous_prompt
        previous_prompt = reply.usage.prompt_tokens
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})


def test_stop_strings_cut_the_reply(server) -> None:
    client = server.client()
    messages = [{"role": "user", "content": user_message(7)}]
    full = chat(client, messages).choices[0].message.content
    words = full.split()
    assert len(words) >= 4, full
    stop = words[2]
    cut = chat(client, messages, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full[: full.index(stop)]
    assert cut.usage.completion_tokens <= MAX_TOKENS
    streamed = chat(client, messages, stop=stop, stream=True)
    assert (
        "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        == (full[: full.index(stop)])
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "no-such-model"}, "model"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "w12 " * 1100}]}, "messages"),
        ({"temperature": 3.0}, "temperature"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 5000}, "max_tokens"),
        ({"n": 17}, "n"),  # over the server's max_n
        ({"seed": 2**63}, "seed"),  # OpenAI's seed is a signed 64-bit integer
        ({"stop": [-3]}, "stop"),
    ],
)
def test_bad_requests_get_400_and_the_server_keeps_serving(server, body, param) -> None:
    request = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "w12 w13"}],
        "max_tokens": 3,
        **body,
    }
    client = server.client(max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**request)
    error = info.value.body
    assert error["type"] == "invalid_request_error"
    assert error["message"]
    assert error["param"] == param
    assert chat(client, [{"role": "user", "content": "w12 w13"}]).choices[0].message.content


def test_a_completion_prompt_over_the_context_gets_400_naming_the_prompt(server) -> None:
    client = server.client(max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=[5] * 5000, max_tokens=2)
    assert info.value.body["param"] == "prompt"
    assert "context length" in info.value.body["message"]


def test_stop_token_ids_and_seeded_sampling_equal_the_request_run_alone(
    server, reference_llm
) -> None:
    from radixkv.engine.sampling_params import SamplingParams

    client = server.client()
    ids = reference_llm.encode("w50 w51 w52")
    (full,) = reference_llm.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))
    stop_id = full.token_ids[3]
    params = SamplingParams(max_tokens=8, stop_token_ids=(stop_id,), ignore_eos=True)
    (cut,) = reference_llm.generate([ids], params)
    assert cut.finish_reason == "stop" and len(cut.token_ids) < len(full.token_ids)
    extra = {"ignore_eos": True}
    reply = client.completions.create(
        model="tiny", prompt=ids, max_tokens=8, temperature=0, stop=[stop_id], extra_body=extra
    )
    assert (reply.choices[0].text, reply.choices[0].finish_reason) == (cut.text, "stop")
    assert reply.usage.completion_tokens == len(cut.token_ids)

    sampled = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.8, seed=1234, ignore_eos=True)
    (alone,) = reference_llm.generate([ids], sampled)
    for _ in range(2):  # the second time, its prompt comes from the cache: the same reply
        reply = client.completions.create(
            model="tiny",
            prompt=ids,
            max_tokens=8,
            temperature=0.9,
            top_p=0.8,
            seed=1234,
            extra_body=extra,
        )
        assert reply.choices[0].text == alone.text


def test_shutdown_stops_the_engine_then_runs_the_shutdown_hooks(make_server) -> None:
    calls: list[bool] = []
    server = make_server(on_shutdown=[lambda: calls.append(server.server_state.engine.is_alive)])
    assert chat(server.client(), [{"role": "user", "content": "w60"}]).choices[0].message.content
    assert calls == []
    server.close()
    assert calls == [False]  # called once, after the engine thread ended


def test_disconnect_mid_stream_aborts_and_returns_the_blocks(server) -> None:
    before = read_metrics(server.base_url)
    client = server.client()
    stream = start_long_stream(client, 3)
    for _, _chunk in zip(range(4), stream, strict=False):
        pass
    stream.close()

    def aborted() -> bool:
        now = read_metrics(server.base_url)
        return (
            metric(now, "radixkv_requests_total", outcome="abort")
            > metric(before, "radixkv_requests_total", outcome="abort")
            and metric(now, "radixkv_blocks", state="in_use") == 0
        )

    wait_until(aborted, what="the abort and the blocks back")
    assert_engine_clean(server)


@contextmanager
def fault_in_next_forward(server):
    """The engine's next model forward raises (a fault inside a step of the real engine)."""
    state = {"armed": True}

    def fail_once(module, args):
        if state["armed"]:
            state["armed"] = False
            raise RuntimeError("injected fault")

    hook = server.on_engine(lambda llm: llm.model.register_forward_pre_hook(fail_once))
    try:
        yield
    finally:
        server.on_engine(lambda llm: hook.remove())
    assert not state["armed"]


def assert_engine_clean(server) -> None:
    assert server.on_engine(lambda llm: llm.cache.stats().num_in_use_blocks) == 0
    server.on_engine(lambda llm: llm.cache.check_integrity())
    server.on_engine(lambda llm: llm.scheduler.check_integrity())


def test_a_client_that_gives_up_on_a_whole_reply_aborts_it(server) -> None:
    before = read_metrics(server.base_url)
    client = server.client(max_retries=0, timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": user_message(8)}],
            max_tokens=900,
            temperature=0,
            extra_body={"ignore_eos": True},
        )

    def aborted() -> bool:
        now = read_metrics(server.base_url)
        return metric(now, "radixkv_requests_total", outcome="abort") > metric(
            before, "radixkv_requests_total", outcome="abort"
        ) and (metric(now, "radixkv_running_requests") == 0)

    wait_until(aborted, what="the abandoned request aborted")
    assert_engine_clean(server)


def test_a_fault_in_a_step_fails_its_request_with_500(server) -> None:
    client = server.client(max_retries=0)
    messages = [{"role": "user", "content": user_message(11)}]
    with fault_in_next_forward(server), pytest.raises(openai.InternalServerError) as info:
        chat(client, messages)
    message = info.value.body["message"]
    assert "RuntimeError" in message and "injected fault" not in message  # no fault's text
    assert info.value.body["type"] == "server_error"
    assert_engine_clean(server)
    assert chat(client, messages).choices[0].message.content


def test_a_fault_in_a_step_ends_a_started_stream_with_an_error_event(server) -> None:
    client = server.client(max_retries=0)
    messages = [{"role": "user", "content": user_message(12)}]
    with fault_in_next_forward(server), pytest.raises(openai.APIError) as info:
        for _ in chat(client, messages, stream=True):
            pass
    assert "RuntimeError" in info.value.message and "injected fault" not in info.value.message
    assert_engine_clean(server)
    reply = chat(client, messages, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in reply if c.choices)


def test_metrics_count_requests_tokens_and_latencies(server) -> None:
    before = read_metrics(server.base_url)
    client = server.client()
    replies = [chat(client, [{"role": "user", "content": user_message(200 + i)}]) for i in range(3)]
    after = read_metrics(server.base_url)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    finished = delta("radixkv_requests_total", outcome="stop") + delta(
        "radixkv_requests_total", outcome="length"
    )
    assert finished == 3
    assert delta("radixkv_prompt_tokens_total") == sum(r.usage.prompt_tokens for r in replies)
    generated = sum(r.usage.completion_tokens for r in replies)
    assert delta("radixkv_generated_tokens_total") == generated
    assert delta("radixkv_cached_tokens_total") == sum(
        r.usage.prompt_tokens_details.cached_tokens for r in replies
    )
    assert delta("radixkv_time_to_first_token_seconds_count") == 3
    assert delta("radixkv_inter_token_latency_seconds_count") == sum(
        r.usage.completion_tokens - 1 for r in replies
    )
    blocks = [metric(after, "radixkv_blocks", state=s) for s in ("free", "evictable", "in_use")]
    assert sum(blocks) == server.llm.cache.num_blocks
    assert 0.0 <= metric(after, "radixkv_cache_hit_rate") <= 1.0
    for name in ("queue_depth", "evicted_blocks_total", "preemptions_total", "running_requests"):
        assert metric(after, f"radixkv_{name}") >= 0


def test_overhead_counts_from_the_whole_request_not_a_late_body(server) -> None:
    """A client that sends its body 0.6 s after its headers: the wait shows as receive time, and
    the server overhead and admission start once the body is in. (The server reads the headers a
    little after they are sent, so it sees a little under 0.6 s of the wait.)"""
    body = json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 2}
    ).encode()
    port = int(server.base_url.rsplit(":", 1)[1])
    before = read_metrics(server.base_url)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        )
        sock.sendall(head.encode())
        time.sleep(0.6)
        sock.sendall(body)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200")
    after = read_metrics(server.base_url)

    def delta(name: str) -> float:
        return metric(after, name) - metric(before, name)

    assert delta("radixkv_request_receive_seconds_count") == 1
    assert delta("radixkv_request_receive_seconds_sum") >= 0.45
    for name in ("server_overhead", "admission"):
        assert delta(f"radixkv_{name}_seconds_count") == 1
        assert delta(f"radixkv_{name}_seconds_sum") < 0.45


def test_a_full_queue_answers_503_with_retry_after(make_server) -> None:
    server = make_server({"max_num_seqs": 1}, max_queued_requests=1)
    client = server.client(max_retries=0)
    running = start_long_stream(client, 5)
    next(iter(running))

    def gauges() -> tuple[float, float]:
        now = read_metrics(server.base_url)
        return metric(now, "radixkv_running_requests"), metric(now, "radixkv_queue_depth")

    wait_until(lambda: gauges() == (1, 0), what="the long request holding the only slot")
    queued: list = []
    waiter = threading.Thread(
        target=lambda: queued.append(chat(client, [{"role": "user", "content": "w40 w41"}]))
    )
    waiter.start()
    wait_until(
        lambda: metric(read_metrics(server.base_url), "radixkv_queue_depth") >= 1,
        what="a request waiting",
    )
    with pytest.raises(openai.APIStatusError) as info:
        chat(client, [{"role": "user", "content": "w42 w43"}])
    assert info.value.status_code == 503
    assert int(info.value.response.headers["Retry-After"]) >= 1
    running.close()  # frees the slot: the queued request runs, nothing was lost
    waiter.join(30)
    assert len(queued) == 1 and queued[0].choices[0].message.content
    assert chat(client, [{"role": "user", "content": "w42 w43"}]).choices[0].message.content


def test_metrics_show_hits_and_moves_by_tier(make_server) -> None:
    """A pool of 12 blocks of 16 and a host tier: the second conversation evicts the first,
    whose repeat is loaded back; /metrics splits the hits by tier and counts the moves."""
    server = make_server({"block_size": 16, "num_blocks": 12, "host_cache_bytes": 2**20})
    client = server.client()
    first, second = ([{"role": "user", "content": user_message(300 + i, 100)}] for i in range(2))
    replies = [chat(client, m) for m in (first, second, first)]
    samples = read_metrics(server.base_url)
    tiers = ("device", "host", "disk")
    hits = {t: metric(samples, "radixkv_cache_hit_tokens_total", tier=t) for t in tiers}
    assert hits["host"] > 0 and hits["disk"] == 0
    assert sum(hits.values()) == sum(r.usage.prompt_tokens_details.cached_tokens for r in replies)
    for move in ("offload", "load"):
        assert metric(samples, "radixkv_tier_moved_bytes_total", move=move) > 0
        assert metric(samples, "radixkv_tier_move_seconds_total", move=move) > 0


def test_a_latent_model_serves_and_its_metrics_count_latent_blocks(make_server, tmp_path) -> None:
    """A tiny DeepSeek V3 (multi-head latent attention) behind the server: its pool is one of
    latent blocks (4 tokens x (L + R) values x 4 layers, fp32), the block gauges count them as a
    request fills and leaves them, and the reply is the engine's run alone."""
    from tiny_archs import build_arch

    from radixkv import LLM, SamplingParams

    path = build_arch("deepseek-v3", tmp_path)
    block_bytes = 4 * (96 + 8) * 4 * 4
    prompt = user_message(21, n=12)
    alone = LLM(str(path), block_size=4, num_blocks=64, enable_prefix_cache=False)
    expected = alone.generate([prompt], SamplingParams(max_tokens=6))[0].text
    server = make_server(engine=dict(block_size=4, num_blocks=64), model=path)
    before = read_metrics(server.base_url)
    assert metric(before, "radixkv_kv_pool_blocks", group="full", layout="latent") == 64
    assert metric(before, "radixkv_kv_block_bytes", group="full", layout="latent") == block_bytes
    assert metric(before, "radixkv_blocks", state="free") == 64
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0}
    status, out = post_json(server.port, body, "/v1/completions")
    assert status == 200 and out["choices"][0]["text"] == expected
    after = read_metrics(server.base_url)
    states = {s: metric(after, "radixkv_blocks", state=s) for s in ("free", "evictable")}
    assert states["evictable"] > 0 and sum(states.values()) == 64  # nothing still in use
    info = dict(block_size="4", num_gpu_blocks="64", enable_prefix_caching="True", engine="0")
    assert metric(after, "vllm:cache_config_info", **info) == 1
    server.close()
