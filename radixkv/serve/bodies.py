"""Request bodies of the completion endpoints: raw JSON in, checked fields out.

The server's door for what clients send, with OpenAI's rules: a field that is absent or `null`
takes its default; unknown fields are ignored; types are strict (a boolean is not a number, a
float is not an integer, a string must be valid Unicode). Every refusal is an APIError(400) whose
`param` names the field as the client sent it (`messages[2].content`, `max_completion_tokens`).
Ranges that are sampling rules (top_p in (0, 1], ...) are `SamplingParams`'s; this module checks
what only the HTTP layer knows: JSON types, OpenAI's own bounds and the server's limits.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from radixkv.serve.protocol import APIError, bad_request
from radixkv.serve.structured import Constraint, read_constraint
from radixkv.serve.tools import ToolRequest, read_tools

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TEMPERATURE = 2.0  # OpenAI's bound; SamplingParams itself takes any temperature >= 0
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's; each entry costs every step of the request
MAX_TOP_LOGPROBS = {True: 20, False: 5}  # chat's top_logprobs, completions' logprobs (OpenAI's)


@dataclass(frozen=True, slots=True)
class BodyLimits:
    """What a body may hold, beyond types: set by the server from its config and its model."""

    vocab_size: int  # token ids (prompt, stop) must be below it
    max_stops: int = 64  # entries of `stop`, and of `stop_token_ids`
    max_stop_chars: int = 512  # characters of one stop string
    # Longest prompt text that could fit the context (None: the model has no tokenizer): longer
    # text is refused before any templating or tokenizing.
    max_prompt_chars: int | None = None
    max_messages: int | None = None  # a chat with more messages than context tokens cannot fit
    max_n: int = 1  # choices of one request


@dataclass(frozen=True, slots=True)
class SamplingFields:
    """The fields both completion endpoints share, checked."""

    model: str | None = None
    max_tokens: int | None = None
    max_tokens_param: str = (
        "max_tokens"  # the field the client used (chat: or max_completion_tokens)
    )
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()  # cut from the text by the server
    stop_token_ids: tuple[int, ...] = ()  # stop the engine: ids of `stop` and `stop_token_ids`
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model says
    cache_salt: str | None = None  # vLLM's tenant isolation field
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    # None: no logprobs; k: each token's logprob and its k most likely alternatives (chat:
    # `logprobs: true` + `top_logprobs: k`; completions: `logprobs: k`)
    logprobs: int | None = None
    constraint: Constraint | None = None  # structured output (`structured.py`)
    # vLLM's and SGLang's sampling extensions (the openai client's `extra_body`), with vLLM's
    # meaning (`SamplingParams`); None: the default, which changes nothing
    top_k: int | None = None  # vLLM's -1 (off) is read as 0
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class ChatBody:
    sampling: SamplingFields
    # {"role", "content"}, content as plain text; an assistant's earlier "tool_calls" and a tool
    # reply's "tool_call_id" kept
    messages: tuple[dict[str, Any], ...]
    tools: ToolRequest | None = None


@dataclass(frozen=True, slots=True)
class CompletionBody:
    sampling: SamplingFields
    prompt: str | tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TokenizeBody:
    """vLLM's TokenizeCompletionRequest (`prompt`) or TokenizeChatRequest (`messages`)."""

    model: str | None
    prompt: str | None
    messages: tuple[dict[str, str], ...] | None
    add_special_tokens: bool | None  # vLLM: True for a prompt, False for messages
    add_generation_prompt: bool
    continue_final_message: bool
    return_token_strs: bool


@dataclass(frozen=True, slots=True)
class DetokenizeBody:
    model: str | None
    tokens: tuple[int, ...]


# A JSON escape of a UTF-16 surrogate: only a body holding one can carry a lone surrogate
# (raw bytes that are not UTF-8 already fail to parse), so most bodies skip the walk.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object whose strings (keys too) are all valid Unicode; APIError(400)
    for anything else, naming where a lone surrogate is. Every route's body comes through here:
    no route sees a string that would fail a tokenizer, a hash or the response encoder."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad_request("the body is not valid JSON: it nests too deeply") from None
    except ValueError as exc:  # includes bytes that are not UTF-8
        raise bad_request(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the body must be a JSON object, got {json_type(body)}")
    if _SURROGATE_ESCAPE.search(raw):
        _check_strings(body, "")
    return body


def _check_strings(value: Any, path: str) -> None:
    """APIError(400) naming the first string under `value` (at `path`) that is not valid
    Unicode. Iterative: a body nested to the parser's limit must not exhaust the stack here."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            _text(item, where or "body")
        elif isinstance(item, list):
            stack.extend((v, f"{where}[{i}]") for i, v in reversed(list(enumerate(item))))
        elif isinstance(item, dict):
            for key in reversed(list(item)):
                name = f"{where}.{key}" if where else key
                _text(key, name)
                stack.append((item[key], name))


def read_chat_body(body: Mapping[str, Any], limits: BodyLimits) -> ChatBody:
    sampling = _sampling_fields(body, limits, chat=True)
    tools = read_tools(body)
    messages = _messages(body, limits)
    if tools is not None and limits.max_prompt_chars is not None:
        # The tools are templated and tokenized with the messages (even under "none"): their
        # text counts against the same bound, before either is.
        num_chars = _chat_chars(messages) + sum(len(json.dumps(t)) for t in tools.tools)
        if num_chars > limits.max_prompt_chars:
            raise _text_too_long(num_chars, limits.max_prompt_chars, "tools")
    if tools is not None and tools.calls_allowed and sampling.constraint is not None:
        param = sampling.constraint.param
        raise bad_request(
            f"{param} conflicts with tool_choice {tools.choice!r}: each constrains the whole "
            'reply (set tool_choice "none", or leave one out)',
            param,
        )
    return ChatBody(sampling, messages, tools)


def read_completion_body(body: Mapping[str, Any], limits: BodyLimits) -> CompletionBody:
    prompt = _prompt(_required(body, "prompt"), "prompt", limits)
    return CompletionBody(_sampling_fields(body, limits, chat=False), prompt)


def read_tokenize_body(body: Mapping[str, Any], limits: BodyLimits) -> TokenizeBody:
    """/tokenize's body under the completion routes' caps (prompt text, messages); exactly one
    of `prompt` and `messages`."""
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt")
    return TokenizeBody(
        model=_text(body.get("model"), "model"),
        prompt=None if prompt is None else _prompt_text(prompt, "prompt", limits),
        messages=None if messages is None else _messages(body, limits),
        add_special_tokens=_bool(body.get("add_special_tokens"), "add_special_tokens"),
        add_generation_prompt=_bool(body.get("add_generation_prompt"), "add_generation_prompt")
        is not False,
        continue_final_message=bool(
            _bool(body.get("continue_final_message"), "continue_final_message")
        ),
        return_token_strs=bool(_bool(body.get("return_token_strs"), "return_token_strs")),
    )


def read_bool(body: Mapping[str, Any], name: str) -> bool | None:
    """The field `name` of `body`: a boolean, or None when absent or null."""
    return _bool(body.get(name), name)


def read_detokenize_body(body: Mapping[str, Any], limits: BodyLimits) -> DetokenizeBody:
    """/detokenize's body: token ids of the vocabulary (integers: `true` and `1.0` are not)."""
    tokens = _token_ids(_required(body, "tokens"), "tokens", limits, capped=False) or ()
    return DetokenizeBody(_text(body.get("model"), "model"), tokens)


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for error messages."""
    if value is None:
        return "null"
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    names.update({list: "an array", dict: "an object"})
    return names.get(type(value), type(value).__name__)


def over_context(num_tokens: int, context: int, param: str) -> APIError:
    return bad_request(
        f"the prompt has {num_tokens} tokens; the model's context length is {context}", param
    )


# ---------------------------------------------------------------------- fields


def _sampling_fields(body: Mapping[str, Any], limits: BodyLimits, *, chat: bool) -> SamplingFields:
    max_param = "max_tokens"
    if chat and body.get("max_completion_tokens") is not None:
        max_param = "max_completion_tokens"
    temperature = _number(body.get("temperature"), "temperature")
    if temperature is not None and temperature > MAX_TEMPERATURE:
        raise bad_request(
            f"temperature must be at most {MAX_TEMPERATURE}, got {temperature}", "temperature"
        )
    stop_strings, stop_ids = _stop(body.get("stop"), limits)
    extra_ids = _token_ids(body.get("stop_token_ids"), "stop_token_ids", limits, capped=True)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _wrong_type("stream_options", "an object", options)
    n = _int(body.get("n"), "n")
    if n is not None and not 1 <= n <= limits.max_n:
        raise bad_request(f"n must be in [1, {limits.max_n}], got {n}", "n")
    max_tokens = _int(body.get(max_param), max_param)
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{max_param} must be at least 1, got {max_tokens}", max_param)
    salt = _text(body.get("cache_salt"), "cache_salt")
    if salt == "":
        raise bad_request("cache_salt must not be empty", "cache_salt")
    _refuse_unsupported(body, chat=chat)
    return SamplingFields(
        model=_text(body.get("model"), "model"),
        n=n or 1,
        max_tokens=max_tokens,
        max_tokens_param=max_param,
        temperature=temperature,
        top_p=_number(body.get("top_p"), "top_p"),
        seed=_seed(body.get("seed")),
        stop_strings=stop_strings,
        stop_token_ids=tuple(dict.fromkeys(stop_ids + (extra_ids or ()))),
        stream=bool(_bool(body.get("stream"), "stream")),
        include_usage=bool(
            options and _bool(options.get("include_usage"), "stream_options.include_usage")
        ),
        ignore_eos=bool(_bool(body.get("ignore_eos"), "ignore_eos")),
        cache_salt=salt,
        presence_penalty=_number(body.get("presence_penalty"), "presence_penalty"),
        frequency_penalty=_number(body.get("frequency_penalty"), "frequency_penalty"),
        logit_bias=_logit_bias(body.get("logit_bias"), limits),
        logprobs=_logprobs(body, chat=chat),
        constraint=read_constraint(body),
        top_k=_top_k(body.get("top_k")),
        min_p=_number(body.get("min_p"), "min_p"),
        repetition_penalty=_number(body.get("repetition_penalty"), "repetition_penalty"),
        min_tokens=_int(body.get("min_tokens"), "min_tokens"),
    )


def _top_k(value: Any) -> int | None:
    """vLLM's top_k: -1 or 0 is off (radixkv's 0), else at least 1."""
    top_k = _int(value, "top_k")
    if top_k is not None and top_k < -1:
        raise bad_request(f"top_k must be -1 or 0 (off), or at least 1, got {top_k}", "top_k")
    return None if top_k is None else max(top_k, 0)


def _seed(value: Any) -> int | None:
    """OpenAI's seed, a signed 64-bit integer, as the engine's unsigned one (two's complement:
    distinct seeds stay distinct)."""
    seed = _int(value, "seed")
    if seed is None:
        return None
    if not -(2**63) <= seed < 2**63:
        raise bad_request(f"seed must be a 64-bit signed integer, got {seed}", "seed")
    return seed % 2**64


def _logprobs(body: Mapping[str, Any], *, chat: bool) -> int | None:
    """How many alternatives each token's logprobs list, None for no logprobs."""
    top_param = "top_logprobs" if chat else "logprobs"
    if chat:
        wanted = _bool(body.get("logprobs"), "logprobs")
        top = _int(body.get("top_logprobs"), "top_logprobs")
        if top is not None and not wanted:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        if not wanted:
            return None
    else:
        top = _int(body.get("logprobs"), "logprobs")
        if top is None:
            return None
    bound = MAX_TOP_LOGPROBS[chat]
    if not 0 <= (top or 0) <= bound:
        raise bad_request(f"{top_param} must be in [0, {bound}], got {top}", top_param)
    return top or 0


def _logit_bias(bias: Any, limits: BodyLimits) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: an object from token ids (as strings) to biases."""
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise _wrong_type("logit_bias", "an object of token ids to numbers", bias)
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad_request(
            f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed",
            "logit_bias",
        )
    pairs = []
    for key, value in bias.items():
        is_id = key.isascii() and key.isdigit() and len(key) <= 12  # int() of 5000 digits fails
        if not is_id or int(key) >= limits.vocab_size:
            raise bad_request(
                f"logit_bias key {key[:20]!r} is not a token id: the vocabulary is "
                f"[0, {limits.vocab_size})",
                "logit_bias",
            )
        number = _number(value, "logit_bias")
        pairs.append((int(key), number))
    return tuple(pairs)


# (field, whether the body's value is supported): each other value is answered 400 naming the field
_UNSUPPORTED_CHAT = (
    ("functions", lambda v: v == []),  # OpenAI's deprecated forms of tools and tool_choice
    ("function_call", lambda v: v == "none"),
)
_UNSUPPORTED_COMPLETION = (
    ("echo", lambda v: v is False),
    ("best_of", lambda v: v == 1 and type(v) is int),
    ("suffix", lambda v: v == ""),
)


def _refuse_unsupported(body: Mapping[str, Any], *, chat: bool) -> None:
    """400 for what this server does not do (tools, structured output, echo, ...), rather than
    a 200 that silently ignores it."""
    for name, supported in _UNSUPPORTED_CHAT if chat else _UNSUPPORTED_COMPLETION:
        value = body.get(name)
        if value is not None and not supported(value):
            raise bad_request(f"{name} is not supported by this server (got {value!r:.60})", name)


def _messages(body: Mapping[str, Any], limits: BodyLimits) -> tuple[dict[str, str], ...]:
    messages = _required(body, "messages")
    if not isinstance(messages, list):
        raise _wrong_type("messages", "an array", messages)
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    if limits.max_messages is not None and len(messages) > limits.max_messages:
        raise bad_request(
            f"{len(messages)} messages cannot fit the model's context of "
            f"{limits.max_messages} tokens",
            "messages",
        )
    out = tuple(_message(m, f"messages[{i}]") for i, m in enumerate(messages))
    num_chars = _chat_chars(out)
    if limits.max_prompt_chars is not None and num_chars > limits.max_prompt_chars:
        raise _text_too_long(num_chars, limits.max_prompt_chars, "messages")
    return out


def _chat_chars(messages: tuple[dict[str, Any], ...]) -> int:
    """The characters of checked messages' text the chat template renders."""
    return sum(len(m["content"]) + len(json.dumps(m.get("tool_calls", ""))) for m in messages)


def _message(message: Any, path: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise _wrong_type(path, "an object", message)
    role = _text(_required(message, "role", path), f"{path}.role")
    if role not in CHAT_ROLES:
        raise bad_request(
            f"{path}.role must be one of {', '.join(CHAT_ROLES)}; got {role!r}", f"{path}.role"
        )
    calls = message.get("tool_calls") if role == "assistant" else None
    if calls is not None and message.get("content") is None:
        content = ""  # OpenAI: an assistant turn that only called tools has no content
    else:
        content = _content(message.get("content"), f"{path}.content")
    out: dict[str, Any] = {"role": role, "content": content}
    if calls is not None:
        out["tool_calls"] = _tool_calls(calls, f"{path}.tool_calls")
    if role == "tool" and message.get("tool_call_id") is not None:
        out["tool_call_id"] = _text(message["tool_call_id"], f"{path}.tool_call_id")
    return out


def _tool_calls(calls: Any, param: str) -> list[dict[str, Any]]:
    """An assistant turn's earlier calls: {id, type, function: {name, arguments (JSON text)}}."""
    if not isinstance(calls, list):
        raise _wrong_type(param, "an array", calls)
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        where = f"{param}[{i}].function"
        if not isinstance(fn, dict):
            raise _wrong_type(where, "an object", fn)
        name = _text(_required(fn, "name", where), f"{where}.name")
        arguments = _text(_required(fn, "arguments", where), f"{where}.arguments")
        call_id = _text(call.get("id"), f"{param}[{i}].id") or f"call_{i}"
        function = {"name": name, "arguments": arguments}
        out.append({"id": call_id, "type": "function", "function": function})
    return out


def _content(content: Any, param: str) -> str:
    """A message's text: a string, or an array of text parts joined."""
    if isinstance(content, str):
        return _text(content, param) or ""
    if not isinstance(content, list):
        raise _wrong_type(param, "a string or an array of text parts", content)
    parts = []
    for i, part in enumerate(content):
        where = f"{param}[{i}]"
        if not isinstance(part, dict):
            raise _wrong_type(where, "an object", part)
        if part.get("type") != "text":
            raise bad_request(
                f"{where}.type {part.get('type')!r} is not supported: only text parts are",
                f"{where}.type",
            )
        parts.append(_text(_required(part, "text", where), f"{where}.text"))
    return "".join(parts)


def _prompt(prompt: Any, param: str, limits: BodyLimits) -> str | tuple[int, ...]:
    """A completion prompt: text, token ids, or an array of one of those (OpenAI's batch form,
    of which one prompt per request is served)."""
    if isinstance(prompt, str):
        return _prompt_text(prompt, param, limits)
    if not isinstance(prompt, list):
        raise _wrong_type(param, "a string or an array of token ids", prompt)
    if not prompt:
        raise bad_request("prompt must not be empty", param)
    if isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request("one prompt per request is supported", param)
        return _prompt(prompt[0], f"{param}[0]", limits)
    return _token_ids(prompt, param, limits, capped=False) or ()


def _prompt_text(prompt: Any, param: str, limits: BodyLimits) -> str:
    """Prompt text: a non-empty string no longer than any text that could fit the context."""
    text = _text(prompt, param)
    if not text:
        raise bad_request("prompt must not be empty", param)
    if limits.max_prompt_chars is not None and len(text) > limits.max_prompt_chars:
        raise _text_too_long(len(text), limits.max_prompt_chars, param)
    return text


def _stop(stop: Any, limits: BodyLimits) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """`stop`: a string, an array of strings, or (as in vLLM) an array of token ids."""
    if stop is None:
        return (), ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list):
        raise _wrong_type("stop", "a string or an array of strings or token ids", stop)
    if stop and type(stop[0]) is int:  # the first entry tells which kind the list is
        return (), _token_ids(stop, "stop", limits, capped=True) or ()
    _check_count(stop, "stop", limits)
    for i, s in enumerate(stop):
        if not isinstance(s, str):
            raise _wrong_type(f"stop[{i}]", "a string (as stop[0])", s)
        _text(s, f"stop[{i}]")
        if len(s) > limits.max_stop_chars:
            raise bad_request(
                f"stop[{i}] has {len(s)} characters; at most {limits.max_stop_chars} are allowed",
                "stop",
            )
    return tuple(stop), ()


def _token_ids(ids: Any, param: str, limits: BodyLimits, *, capped: bool) -> tuple[int, ...] | None:
    """Token ids in the vocabulary; `capped`: at most `limits.max_stops` of them (stop ids)."""
    if ids is None:
        return None
    if not isinstance(ids, list):
        raise _wrong_type(param, "an array of token ids", ids)
    if capped:
        _check_count(ids, param, limits)
    for i, t in enumerate(ids):
        if type(t) is not int:
            raise _wrong_type(f"{param}[{i}]", "an integer (a token id)", t)
        if not 0 <= t < limits.vocab_size:
            raise bad_request(
                f"{param}[{i}] = {t} is not a token id: the vocabulary is [0, {limits.vocab_size})",
                param,
            )
    return tuple(ids)


def _check_count(items: list[Any], param: str, limits: BodyLimits) -> None:
    if len(items) > limits.max_stops:
        raise bad_request(
            f"{param} has {len(items)} entries; at most {limits.max_stops} are allowed", param
        )


# ---------------------------------------------------------------------- JSON types


def _required(obj: Mapping[str, Any], name: str, path: str = "") -> Any:
    value = obj.get(name)
    if value is None:
        param = f"{path}.{name}" if path else name
        raise APIError(400, f"{param} is required", param=param, code="missing_required_parameter")
    return value


def _int(value: Any, param: str) -> int | None:
    if value is None or type(value) is int:
        return value
    raise _wrong_type(param, "an integer", value)


def _number(value: Any, param: str) -> float | None:
    if value is None:
        return None
    if type(value) not in (int, float):
        raise _wrong_type(param, "a number", value)
    if not math.isfinite(value):  # json.loads reads NaN and Infinity
        raise bad_request(f"{param} must be a finite number, got {value}", param)
    return float(value)


def _bool(value: Any, param: str) -> bool | None:
    if value is None or type(value) is bool:
        return value
    raise _wrong_type(param, "a boolean", value)


def _text(value: Any, param: str) -> str | None:
    """A string that is valid Unicode: JSON's \\ud800-\\udfff escapes can carry lone surrogates,
    which no tokenizer, hash or response encoder accepts."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise _wrong_type(param, "a string", value)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(
            f"{param} is not valid Unicode: a lone surrogate {value[exc.start]!r} at "
            f"character {exc.start}",
            param,
        ) from None
    return value


def _wrong_type(param: str, expected: str, value: Any) -> APIError:
    return APIError(
        400,
        f"Invalid type for '{param}': expected {expected}, but got {json_type(value)} instead.",
        param=param,
        code="invalid_type",
    )


def _text_too_long(num_chars: int, max_chars: int, param: str) -> APIError:
    return bad_request(
        f"the prompt text has {num_chars} characters: more than the model's context can hold "
        f"(at most {max_chars}, the context length times the longest token's characters)",
        param,
    )
