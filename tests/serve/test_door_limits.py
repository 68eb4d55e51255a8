"""Bodies that cost the server more than they should (issue 43: item 4 and the smaller door
items), against live servers on 127.0.0.1: tool text counts against the prompt's bound before
any templating, a schema nested too deep is a 400 naming its depth, `n` past the queue is a
400 saying the limit, a stop string inside jump-forward text bills what one token at a time
would, and `json_schema` without a schema means any JSON object."""

from __future__ import annotations

import json
import threading

import pytest
from serve_helpers import chat_request, post_json
from tiny_llama import build_char_tokenizer, build_model

from radixkv.serve.structured import MAX_SCHEMA_DEPTH, read_constraint

post = post_json


def chat(**fields) -> dict:
    return chat_request("w12 w13", **{"max_tokens": 2, **fields})


def tool(description: str = "f", parameters: dict | None = None) -> dict:
    function = {"name": "f", "description": description}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


def test_tool_text_over_the_prompt_bound_is_refused_before_templating(server, monkeypatch):
    """Item 4: before, a description of any length (under tool_choice "none" too) was
    templated and tokenized in the one preparation thread, where the same text as a message
    is refused at once. Three such bodies at once, two rounds: each a 400 naming `tools`,
    and the template never runs; a plain chat is served between rounds."""
    calls: list = []
    monkeypatch.setattr(server.llm, "encode_chat", lambda *a, **k: calls.append(a))
    bound = server.server_state.limits.max_prompt_chars
    long_text = "w12 " * (bound // 4 + 1)
    results: list = []
    for _ in range(2):
        bodies = [chat(tools=[tool(long_text)], tool_choice=c) for c in ("none", "auto", None)]
        threads = [
            threading.Thread(target=lambda b=b: results.append(post(server.port, b)))
            for b in bodies
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert len(results) == 6
    for status, body in results:
        assert status == 400 and body["error"]["param"] == "tools", body
        assert "characters" in body["error"]["message"]
    assert calls == []
    monkeypatch.undo()
    status, body = post(server.port, chat())
    assert status == 200, body


def test_messages_and_tools_together_over_the_bound_are_refused(server):
    bound = server.server_state.limits.max_prompt_chars
    half = "w12 " * (bound // 8 + 1)
    status, body = post(
        server.port, chat(messages=[{"role": "user", "content": half}], tools=[tool(half)])
    )
    assert status == 400 and body["error"]["param"] == "tools", body


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [tool(parameters=nested(600))]}, "tools[0].function.parameters"),
        (
            {"tools": [tool(parameters=nested(MAX_SCHEMA_DEPTH + 1))], "tool_choice": "none"},
            "tools[0].function.parameters",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": nested(600)},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"json": nested(600)}}, "structured_outputs.json"),
    ],
)
def test_a_schema_nested_too_deep_is_a_400_naming_its_depth(server, fields, param):
    """Before, tool parameters 600 deep raised RecursionError: a 500."""
    status, body = post(server.port, chat(**fields))
    assert status == 400, body
    assert body["error"]["param"] == param
    assert f"more than {MAX_SCHEMA_DEPTH} objects and arrays deep" in body["error"]["message"]


def test_a_schema_at_the_depth_bound_is_served(server):
    status, body = post(server.port, chat(tools=[tool(parameters=nested(MAX_SCHEMA_DEPTH))]))
    assert status == 200, body


def test_n_past_the_queue_is_a_400_saying_the_limit(make_server):
    """Before: a 503 with Retry-After even on an idle server, so a retry never worked."""
    server = make_server(max_queued_requests=4)
    status, body = post(server.port, chat(n=5))
    assert status == 400 and body["error"]["param"] == "n", body
    assert "[1, 4]" in body["error"]["message"]
    status, body = post(server.port, chat(n=4, temperature=1.0))
    assert status == 200 and len(body["choices"]) == 4, body


def test_json_schema_without_a_schema_means_any_json_object():
    """OpenAI: an absent schema is any JSON object; before, it compiled as any JSON value."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x"}}
    constraint = read_constraint({"response_format": fmt})
    assert constraint is not None and constraint.kind == "json_object"
    assert constraint.param == "response_format.json_schema.schema"


@pytest.fixture(scope="module")
def char_servers(make_server):
    """Servers of the character model with jump-forward on and off."""
    pytest.importorskip("xgrammar")
    return {
        jump: make_server(
            dict(tokenizer=build_char_tokenizer(), jump_forward=jump), model=build_model("gqa")
        )
        for jump in (True, False)
    }


def test_a_stop_string_inside_forced_text_bills_what_is_returned(char_servers):
    """Before, the whole jump was billed: the forced word's 22 tokens. Now the tokens up to
    the stop string's end: with jump-forward the word's canonical tokens through "full",
    without it the tokens sampled one at a time through "full" (the model may spell it in
    more); both return the same text."""
    word = "customer_full_name_and_address"
    body = chat(structured_outputs={"choice": [word]}, stop=["full"], max_tokens=100)
    replies = {jump: post(server.port, body) for jump, server in char_servers.items()}
    for status, reply in replies.values():
        assert status == 200, reply
        assert reply["choices"][0]["message"]["content"] == "customer_"
        assert reply["choices"][0]["finish_reason"] == "stop"
    billed = {jump: reply["usage"]["completion_tokens"] for jump, (_, reply) in replies.items()}
    tok = char_servers[True].llm.tokenizer
    canonical = len(tok.encode("customer_full", add_special_tokens=False))
    assert billed[True] == canonical < len(tok.encode(word, add_special_tokens=False)), billed
    assert canonical <= billed[False] <= len("customer_full"), billed


def test_json_schema_without_a_schema_gives_an_object(char_servers):
    server = char_servers[True]
    vocab = server.llm.tokenizer.get_vocab()
    bias = {str(vocab['"']): 100, str(vocab["}"]): 90}  # noise alone may never close it
    fmt = {"type": "json_schema", "json_schema": {"name": "x"}}
    status, reply = post(
        server.port, chat(response_format=fmt, logit_bias=bias, max_tokens=200, temperature=1.0)
    )
    assert status == 200, reply
    assert isinstance(json.loads(reply["choices"][0]["message"]["content"]), dict)
