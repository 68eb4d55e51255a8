"""The OpenAI wire format: request bodies (pydantic), error bodies and response objects.

Only what the server implements is modelled; unknown fields are ignored, as OpenAI-compatible
servers do. Range checks that OpenAI documents (temperature <= 2) live here; the rest of the
sampling rules are `SamplingParams`'s.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

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


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class SamplingFields(BaseModel):
    """Fields both completion endpoints share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = Field(default=None, le=2.0)
    top_p: float | None = None
    seed: int | None = None
    # Strings (cut from the text by the server) or token ids (stop the engine), like vLLM.
    stop: str | list[str] | list[int] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model says
    cache_salt: str | None = Field(default=None, min_length=1)  # vLLM's tenant isolation field

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        if isinstance(self.stop, str):
            return [self.stop]
        return [s for s in self.stop if isinstance(s, str)]

    def stop_ids(self) -> tuple[int, ...]:
        ids = [t for t in self.stop or () if isinstance(t, int)] if self.stop else []
        return tuple(ids + list(self.stop_token_ids or ()))

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]


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
    rid: str, model: str, text: str, finish_reason: str, usage_: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
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
) -> dict[str, Any]:
    """A chat stream chunk; `delta=None` makes the final usage-only chunk (no choices)."""
    choices = (
        []
        if delta is None
        else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
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
) -> dict[str, Any]:
    """A completion or one stream chunk of it (`text=None`: the final usage-only chunk)."""
    choices = (
        []
        if text is None
        else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]
    )
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage_,
    }
