"""Tool calls below the HTTP layer: generated parameter schemas forced through the engine in both
step modes always give calls that parse and validate; the reader splits replies pushed in any
pieces into the same text and calls; tools reach a template that renders them, and the system
turn of one that does not."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schema_strategies import SCHEMAS
from tiny_llama import CHATML, build_char_tokenizer, build_model, random_prompts

from radixkv import LLM, SamplingParams
from radixkv.engine.model.chat_template import encode_chat
from radixkv.serve.tools import (
    CALL_BEGIN,
    MAX_PARALLEL_CALLS,
    ToolCallReader,
    ToolRequest,
    messages_with_tools,
    template_renders_tools,
    tool_constraint,
    tools_system_text,
)

jsonschema = pytest.importorskip("jsonschema")  # test extras: absent on the GPU machine
pytest.importorskip("xgrammar")

PROMPT = random_prompts(5, 1, min_len=4, max_len=8)[0]


@pytest.fixture(scope="module")
def engines() -> dict[bool, LLM]:
    model, tokenizer = build_model("gqa"), build_char_tokenizer()
    return {
        on: LLM(model, tokenizer=tokenizer, async_scheduling=on, num_blocks=256)
        for on in (False, True)
    }


def _tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


_PARAMETERS = st.dictionaries(
    st.text("abcxyz", min_size=1, max_size=4), SCHEMAS, min_size=1, max_size=3
).map(lambda props: {"type": "object", "properties": props, "required": sorted(props)})


# A sampled reply of a random model under a grammar is as long as its draws make it: a fresh
# run drew one past 800 tokens (nested arrays of long numbers: 'length', not 'stop'). Room for
# the tail of that distribution, and the same examples in every run of one suite.
@settings(
    max_examples=10,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    schemas=st.lists(_PARAMETERS, min_size=1, max_size=3),
    choice=st.sampled_from(["required", "named"]),
    parallel=st.booleans(),
    sampled=st.booleans(),
    seed=st.integers(0, 2**32),
)
def test_forced_calls_parse_and_validate_in_both_step_modes(
    engines, schemas, choice, parallel, sampled, seed
):
    tools = tuple(_tool(f"f{i}", s) for i, s in enumerate(schemas))
    request = ToolRequest(tools, "f0" if choice == "named" else choice, parallel)
    constraint = tool_constraint(request)
    assert constraint is not None
    params = SamplingParams(
        max_tokens=3000,
        temperature=1.0 if sampled else 0.0,
        seed=seed,
        structural_tag=constraint.value,
    )
    for on, llm in engines.items():
        (out,) = llm.generate([PROMPT], params)
        llm.check_integrity()
        assert out.finish_reason == "stop", (on, out.text)
        reader = ToolCallReader(request.names)
        text, calls = reader.push(out.text)
        text += reader.finish()
        assert calls and not text.strip(), (on, out.text)
        several = parallel and choice != "named"
        assert len(calls) == 1 or (several and len(calls) <= MAX_PARALLEL_CALLS)
        for call in calls:
            name = call["function"]["name"]
            assert choice != "named" or name == "f0"
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[int(name[1:])])


REPLY = f'Let me look.{CALL_BEGIN}{{"name": "f", "arguments": {{"a": "<x>"}}}}</tool_call>\n' + (
    f'{CALL_BEGIN}{{"name": "g", "arguments": {{}}}}</tool_call>ok <tool'
)


@pytest.mark.parametrize("piece", [1, 3, 7, len(REPLY)])
def test_the_reader_gives_the_same_text_and_calls_for_any_pieces(piece):
    reader = ToolCallReader(["f", "g"])
    text, calls = "", []
    for i in range(0, len(REPLY), piece):
        t, c = reader.push(REPLY[i : i + piece])
        reader.check_integrity()
        text, calls = text + t, calls + c
    text += reader.finish()
    assert text == "Let me look.\nok <tool"
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "f"), (1, "g")]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": "<x>"}, {}]


def test_tools_reach_a_template_that_renders_them_and_the_system_turn_otherwise():
    tok = build_char_tokenizer()
    tools = [_tool("lookup", {"type": "object", "properties": {}})]
    messages = [{"role": "user", "content": "hi"}]
    assert not template_renders_tools(tok)
    shown = messages_with_tools(messages, tools)
    assert shown[0] == {"role": "system", "content": tools_system_text(tools)}
    with_system = messages_with_tools(
        [{"role": "system", "content": "Be brief."}, *messages], tools
    )
    assert with_system[0]["content"].startswith("Be brief.\n\n# Tools")
    tok.chat_template = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}" + CHATML
    assert template_renders_tools(tok)
    ids = encode_chat(tok, messages, parse_special_tokens=False, tools=tools)
    assert tok.decode(ids).startswith("[lookup]")


def test_earlier_calls_are_written_as_the_model_writes_them():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    messages = [{"role": "assistant", "content": "", "tool_calls": [call]}]
    (_, written) = messages_with_tools(messages, [_tool("f", {})])
    reader = ToolCallReader(["f"])
    text, calls = reader.push(written["content"])
    assert text == "" and calls[0]["function"]["arguments"] == '{"a": 1}'
