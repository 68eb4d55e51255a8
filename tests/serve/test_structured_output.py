"""Structured output and tool calls through a live server, read by the real `openai` client, on
a tiny random model with a character-level tokenizer (its unconstrained output is noise):
response_format (json_object, json_schema, `parse()` with a pydantic model), vLLM's
`structured_outputs` and `guided_*` fields, tools with each tool_choice, streamed and not; bad
input gets a 400 naming the field, a grammar too slow to compile among them, while the server
goes on serving."""

from __future__ import annotations

import json
import re

import pytest
from tiny_llama import build_char_tokenizer, build_model

openai = pytest.importorskip("openai")  # a test extra: absent on the GPU machine
pydantic = pytest.importorskip("pydantic")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.fixture(scope="module")
def server(make_server):
    engine = dict(tokenizer=build_char_tokenizer())
    return make_server(
        engine, model=build_model("gqa"), grammar_compile_timeout_s=0.3, max_grammar_compiles=1
    )


def chat(client, **kwargs):
    kwargs = {"model": "tiny", "messages": MESSAGES, "max_tokens": 200} | kwargs
    return client.chat.completions.create(**kwargs)


def _valid_calls(calls) -> None:
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    population: int = pydantic.Field(ge=0, le=10_000)
    capital: bool


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_parse_with_a_pydantic_model_returns_the_object(server, temperature):
    client = server.client()
    reply = client.chat.completions.parse(
        model="tiny", messages=MESSAGES, response_format=City, temperature=temperature, seed=3
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    assert City.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_schema_streamed_validates(server):
    schema = {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}
    stream = chat(server.client(), response_format=fmt, stream=True, temperature=0)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), schema)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_json_object_gives_an_object(server):
    vocab = server.llm.tokenizer.get_vocab()
    # Noise alone may never close an object (strings are unbounded): steer it to an end.
    bias = {str(vocab['"']): 100, str(vocab["}"]): 90}
    reply = chat(server.client(), response_format={"type": "json_object"}, logit_bias=bias)
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"structured_outputs": {"regex": "[0-9]{2}-[a-z]{2}"}}, r"[0-9]{2}-[a-z]{2}"),
        ({"structured_outputs": {"choice": ["red", "blue"]}}, r"red|blue"),
        ({"structured_outputs": {"grammar": 'root ::= "x" [0-9] [0-9]? | "y"'}}, r"x[0-9]{1,2}|y"),
        ({"guided_regex": "(ab){1,3}c"}, r"(ab){1,3}c"),
        ({"guided_choice": ["one", "two"]}, r"one|two"),
        ({"guided_json": {"type": "integer", "minimum": 3, "maximum": 9}}, r"[3-9]"),
    ],
)
def test_vllms_fields_constrain_chat_and_completions(server, extra, check):
    client = server.client()
    reply = chat(client, extra_body=extra, temperature=0)
    assert reply.choices[0].finish_reason == "stop"
    assert re.fullmatch(check, reply.choices[0].message.content)
    done = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=200, temperature=1.0, seed=5, extra_body=extra
    )
    assert done.choices[0].finish_reason == "stop"
    assert re.fullmatch(check, done.choices[0].text)


# ------------------------------------------------------------------ tools


def _required(server, **kwargs):
    return chat(server.client(), tools=[WEATHER, TIME], tool_choice="required", **kwargs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_tool_calls_parse_and_match_their_schemas(server, temperature):
    reply = _required(server, temperature=temperature, seed=11)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.tool_calls
    _valid_calls(choice.message.tool_calls)


def test_a_named_function_is_the_one_called_once(server):
    named = {"type": "function", "function": {"name": "get_time"}}
    reply = chat(server.client(), tools=[WEATHER, TIME], tool_choice=named, temperature=0)
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in calls] == ["get_time"]
    _valid_calls(calls)


def test_parallel_tool_calls_false_allows_one_call(server):
    for seed in range(3):
        reply = _required(server, parallel_tool_calls=False, temperature=1.0, seed=seed)
        assert len(reply.choices[0].message.tool_calls) == 1


def test_auto_calls_after_the_trigger_and_none_leaves_text(server):
    client = server.client()
    trigger = server.llm.tokenizer.get_vocab()["<tool_call>"]
    # The model chooses between text and a call: a bias on the trigger makes it choose a call.
    bias = {str(trigger): 100}
    reply = chat(client, tools=[WEATHER], logit_bias=bias, parallel_tool_calls=False, seed=1)
    assert reply.choices[0].finish_reason == "tool_calls"
    _valid_calls(reply.choices[0].message.tool_calls)
    plain = chat(client, tools=[WEATHER], tool_choice="none", max_tokens=5, temperature=0)
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].message.content


def test_streamed_tool_calls_carry_their_index_and_equal_the_whole_reply(server):
    client = server.client()
    kwargs = dict(tools=[WEATHER, TIME], tool_choice="required", temperature=0)
    whole = chat(client, **kwargs).choices[0].message.tool_calls
    deltas = [
        d
        for c in chat(client, stream=True, **kwargs)
        if c.choices
        for d in c.choices[0].delta.tool_calls or []
    ]
    assert [d.index for d in deltas] == list(range(len(whole)))
    assert [(d.function.name, d.function.arguments) for d in deltas] == [
        (c.function.name, c.function.arguments) for c in whole
    ]


def test_a_conversation_with_earlier_calls_and_results_continues(server):
    first = chat(server.client(), tools=[WEATHER], tool_choice="required", temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    reply = chat(server.client(), messages=messages, tools=[WEATHER], tool_choice="none")
    assert reply.usage.prompt_tokens > first.usage.prompt_tokens


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "no-such-type"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice"),
        ({"guided_grammar": "root ::= nowhere"}, "guided_grammar"),
        ({"guided_choice": "abc"}, "guided_choice"),
        ({"guided_choice": []}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice.function.name",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 1}}]}, "tools"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"},
            "guided_regex",
        ),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"guided_regex": "a" * 70_000}, "guided_regex"),
        ({"structured_outputs": {"choice": ["x"] * 1025}}, "structured_outputs.choice"),
    ],
)
def test_bad_structured_fields_get_400_naming_them(server, fields, param):
    client = server.client(max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, extra_body=fields)
    assert info.value.body["param"].startswith(param), info.value.body


def test_a_grammar_too_slow_to_compile_gets_400_and_others_are_served(server):
    """A pattern's compile time grows with its bound squared: this one takes seconds, over the
    server's 0.3 s. The request is refused and its compile killed; one sent after it is
    answered, and the same grammar sent again is refused at once (no worker is taken)."""
    client = server.client(max_retries=0)
    slow = {"type": "string", "pattern": "^.{0,1500}$"}
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, extra_body={"guided_json": slow})
    assert info.value.body["param"] == "guided_json"
    assert "compile" in info.value.body["message"]
    plain = chat(client, max_tokens=3, temperature=0)  # the event loop was never blocked
    assert plain.choices[0].message.content is not None
    pool = server.server_state.grammars
    started = pool.num_started
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, extra_body={"guided_json": slow})
    assert "did not compile within 0.3 s" in info.value.body["message"]
    assert pool.num_started == started
    reply = chat(client, extra_body={"guided_regex": "[ab]{2}"}, max_tokens=5, temperature=0)
    assert re.fullmatch("[ab]{2}", reply.choices[0].message.content)
    pool.check_integrity()
