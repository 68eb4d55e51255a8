"""Tool calls in OpenAI's shapes: `tools`, `tool_choice`, `parallel_tool_calls` checked; the
tools shown to the model; its calls forced by a grammar; its reply read back into
`message.tool_calls`.

The model writes a call as Hermes-style tags (the format Qwen's and many other chat templates
teach), one tag per call:

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

A chat template that renders `tools` itself (its source mentions them) gets them as
`apply_chat_template(..., tools=...)`; any other gets them in the system turn, in the text of
`tools_system_text` (the README shows it). The grammar is an xgrammar structural tag whose tags
begin with `<tool_call>{"name": "<function>", "arguments": ` and hold the function's parameter
schema: `required` and a named function constrain the whole reply to calls (one for a named
function, up to MAX_PARALLEL_CALLS for `required`, newline-separated); `auto` leaves text free
until the `<tool_call>` trigger, then forces a well-formed call. `parallel_tool_calls: false`
allows one call.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from radixkv.engine.sampling.grammar import json_schema_for_xgrammar
from radixkv.serve.protocol import bad_request
from radixkv.serve.structured import Constraint, check_schema_depth

CALL_BEGIN = "<tool_call>"
CALL_END = "</tool_call>"
MAX_TOOLS = 128
# Calls in one reply under tool_choice "required" (a bound keeps a model that would call
# forever from running to max_tokens); "auto" leaves text, and so the reply, unbounded.
MAX_PARALLEL_CALLS = 8
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A request's tools, checked. `choice`: "none", "auto", "required", or the name of the
    function it must call."""

    tools: tuple[dict[str, Any], ...]  # {"type": "function", "function": {name, ...}}
    choice: str
    parallel: bool

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t["function"]["name"] for t in self.tools)

    @property
    def calls_allowed(self) -> bool:
        return self.choice != "none"


def read_tools(body: Mapping[str, Any]) -> ToolRequest | None:
    """The body's tools, None without any. APIError(400) naming the field for a malformed
    tool, an unknown forced function, or a tool_choice without tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool) and parallel is not None:
        raise bad_request("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad_request(f"tools must be an array of at most {MAX_TOOLS} tools", "tools")
    checked = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(tools))
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise bad_request("tools must have distinct function names", "tools")
    return ToolRequest(checked, _choice(choice, names), parallel is not False)


def _tool(tool: Any, param: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise bad_request(f'{param} must be an object with "type": "function"', f"{param}.type")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise bad_request(f"{param}.function must be an object", f"{param}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad_request(
            f"{param}.function.name must be 1 to 64 letters, digits, _ or -; got {name!r:.70}",
            f"{param}.function.name",
        )
    parameters = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise bad_request(
            f"{param}.function.parameters must be an object (a JSON schema)",
            f"{param}.function.parameters",
        )
    check_schema_depth(parameters, f"{param}.function.parameters")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(
            f"{param}.function.description must be a string", f"{param}.function.description"
        )
    function = {"name": name, "parameters": parameters}
    if description is not None:
        function["description"] = description
    return {"type": "function", "function": function}


def _choice(choice: Any, names: Sequence[str]) -> str:
    if choice is None:
        return "auto"  # OpenAI's default when tools are given
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if name in names:
            return name
        raise bad_request(
            f"tool_choice names the function {name!r:.70}, which is not among the tools",
            "tool_choice.function.name",
        )
    raise bad_request(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
        '{"name": ...}}',
        "tool_choice",
    )


# ---------------------------------------------------------------------- the grammar


def tool_constraint(request: ToolRequest) -> Constraint | None:
    """The structural tag that forces the reply's calls (None for tool_choice "none")."""
    if not request.calls_allowed:
        return None
    forced = request.choice not in ("auto", "required")
    tools = [t for t in request.tools if not forced or t["function"]["name"] == request.choice]
    tags = [_tag(t["function"]) for t in tools]
    most = 1 if forced or not request.parallel else MAX_PARALLEL_CALLS
    if request.choice == "auto":
        fmt = {
            "type": "triggered_tags",
            "triggers": [CALL_BEGIN],
            "tags": tags,
            "stop_after_first": most == 1,
        }
    else:  # one call, then up to `most - 1` more, each after a newline
        call = {"type": "or", "elements": tags}
        more = {"type": "sequence", "elements": [{"type": "const_string", "value": "\n"}, call]}
        repeat = {"type": "repeat", "min": 0, "max": most - 1, "content": more}
        fmt = call if most == 1 else {"type": "sequence", "elements": [call, repeat]}
    text = json.dumps({"type": "structural_tag", "format": fmt})
    return Constraint("structural_tag", text, "tools")


def _tag(function: Mapping[str, Any]) -> dict[str, Any]:
    schema = json.loads(json_schema_for_xgrammar(json.dumps(function["parameters"])))
    return {
        "type": "tag",
        "begin": f'{CALL_BEGIN}{{"name": {json.dumps(function["name"])}, "arguments": ',
        "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1},
        "end": "}" + CALL_END,
    }


# ---------------------------------------------------------------------- the prompt


def tools_system_text(tools: Sequence[Mapping[str, Any]]) -> str:
    """How the tools are shown to a model whose chat template does not render them."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query. The "
        f"functions are listed below, one JSON object per line:\n<tools>\n{listed}\n</tools>\n\n"
        "To call a function, reply with its name and arguments as a JSON object inside "
        f'{CALL_BEGIN}{CALL_END} tags:\n{CALL_BEGIN}{{"name": <function-name>, "arguments": '
        f"<arguments-object>}}{CALL_END}"
    )


def template_renders_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def messages_with_tools(
    messages: Sequence[dict[str, Any]], tools: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """`messages` with the tools text in the system turn (appended to the first system message,
    or as a new one in front), and earlier assistant calls written as the model writes them."""
    text = tools_system_text(tools)
    out = [_calls_as_text(m) for m in messages]
    if out and out[0]["role"] == "system":
        return [{**out[0], "content": f"{out[0]['content']}\n\n{text}"}, *out[1:]]
    return [{"role": "system", "content": text}, *out]


def _calls_as_text(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    written = "".join(
        f'{CALL_BEGIN}{{"name": {json.dumps(c["function"]["name"])}, "arguments": '
        f"{c['function']['arguments']}}}{CALL_END}"
        for c in calls
    )
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": message["content"] + written}


# ---------------------------------------------------------------------- reading the reply


class ToolCallReader:
    """Splits a reply, pushed in pieces, into content text and complete tool calls. Text that
    may be the start of a call is held back until it is one (or the reply ends).

    Invariant between pushes: what is held back is a call begun and not finished (it starts
    with CALL_BEGIN) or a proper beginning of CALL_BEGIN; `num_calls` calls were given out."""

    def __init__(self, names: Sequence[str]) -> None:
        self._names = frozenset(names)
        self._held = ""
        self.num_calls = 0

    def push(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The content text now known not to be part of a call, and the calls completed."""
        self._held += text
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while True:
            at = self._held.find(CALL_BEGIN)
            if at < 0:
                keep = _prefix_overlap(self._held, CALL_BEGIN)
                cut = len(self._held) - keep
                content.append(self._held[:cut])
                self._held = self._held[cut:]
                break
            content.append(self._held[:at])
            call, end = self._parse_call(self._held, at)
            if call is None:
                self._held = self._held[at:]
                break
            calls.append(call)
            self._held = self._held[end:]
        return "".join(content), calls

    def check_integrity(self) -> None:
        held = self._held
        assert held.startswith(CALL_BEGIN) or (
            len(held) < len(CALL_BEGIN) and CALL_BEGIN.startswith(held)
        ), held
        assert self.num_calls >= 0

    def finish(self) -> str:
        """What is still held back, as text (a call the reply left unfinished)."""
        held, self._held = self._held, ""
        return held

    def _parse_call(self, text: str, at: int) -> tuple[dict[str, Any] | None, int]:
        start = at + len(CALL_BEGIN)
        try:
            obj, end = json.JSONDecoder().raw_decode(text, start)
        except ValueError:
            return None, at
        if not text.startswith(CALL_END, end):
            return None, at
        if not isinstance(obj, dict) or obj.get("name") not in self._names:
            return None, at
        arguments = obj.get("arguments", {})
        call = {
            "index": self.num_calls,
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(arguments)},
        }
        self.num_calls += 1
        return call, end + len(CALL_END)


def _prefix_overlap(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
