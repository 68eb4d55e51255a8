"""The OpenAI wire format: error bodies and response objects (request bodies: `bodies.py`)."""

from __future__ import annotations

import json
import time
from typing import Any

from radixkv.engine.outputs import RequestOutput


class APIError(Exception):
    """An error answered with an OpenAI-style body: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def body_bytes(self) -> bytes:
        # ASCII escapes: a message may quote what a client sent, lone surrogates included.
        return json.dumps(self.body()).encode()


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def shutting_down() -> APIError:
    """The answer to a request the server will not finish: it is shutting down."""
    return APIError(
        503,
        "the server is shutting down; retry on another replica",
        type="server_shutting_down",
        headers={"Connection": "close"},
    )


def usage(output: RequestOutput, num_completion_tokens: int | None = None) -> dict[str, Any]:
    """The usage object; `num_completion_tokens` overrides the engine's count (a stop string)."""
    stats = output.stats
    completion = stats.num_output_tokens if num_completion_tokens is None else num_completion_tokens
    return {
        "prompt_tokens": stats.num_prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": stats.num_prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": stats.num_cached_tokens},
    }


def chat_response(
    rid: str,
    model: str,
    text: str,
    finish_reason: str,
    usage_: dict[str, Any],
    logprobs: dict[str, Any] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    """A chat reply; with `tool_calls` (each with its stream `index`, dropped here), its content
    is None when no text came besides them."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["content"] = text.strip() or None
        message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in tool_calls]
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage_,
    }


def chat_chunk(
    rid: str,
    model: str,
    delta: dict[str, Any] | None,
    finish_reason: str | None = None,
    usage_: dict[str, Any] | None = None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    """A chat stream chunk; `delta=None` makes the final usage-only chunk (no choices)."""
    choices = (
        []
        if delta is None
        else [
            {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        ]
    )
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage_,
    }


def completion_response(
    rid: str,
    model: str,
    text: str | None,
    finish_reason: str | None,
    usage_: dict[str, Any] | None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    """A completion or one stream chunk of it (`text=None`: the final usage-only chunk)."""
    choices = (
        []
        if text is None
        else [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]
    )
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage_,
    }
