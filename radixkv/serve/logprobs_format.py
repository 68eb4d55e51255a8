"""A reply's logprobs in OpenAI's two shapes.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}]}], "refusal": null}`. Completions (the legacy shape): `{"tokens", "token_logprobs",
"top_logprobs": [{token: logprob}], "text_offset"}`, offsets counted from the reply's start.
A stream sends each chunk's share; a whole reply, all of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from radixkv.engine.outputs import TokenLogprobs


class LogprobsWriter:
    """One reply's logprobs, chunk after chunk. `token_text`: a token id's text."""

    def __init__(self, token_text: Callable[[int], str], *, chat: bool) -> None:
        self._text = token_text
        self._chat = chat
        self._offset = 0  # characters of the reply's tokens written so far (completions)

    def __call__(self, logprobs: Sequence[TokenLogprobs]) -> dict[str, Any]:
        return self._chat_shape(logprobs) if self._chat else self._completion_shape(logprobs)

    def _chat_shape(self, logprobs: Sequence[TokenLogprobs]) -> dict[str, Any]:
        content = []
        for lp in logprobs:
            entry = self._entry(lp.token_id, lp.logprob)
            entry["top_logprobs"] = [self._entry(t, v) for t, v in lp.top]
            content.append(entry)
        return {"content": content, "refusal": None}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _completion_shape(self, logprobs: Sequence[TokenLogprobs]) -> dict[str, Any]:
        tokens = [self._text(lp.token_id) for lp in logprobs]
        offsets = []
        for token in tokens:
            offsets.append(self._offset)
            self._offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{self._text(t): v for t, v in lp.top} for lp in logprobs],
            "text_offset": offsets,
        }


def token_texts(tokenizer: Any) -> Callable[[int], str]:
    """A token id's text, special tokens spelled out (vLLM's `token_id:N` without a tokenizer);
    remembered, since a reply's tokens and alternatives repeat."""
    cache: dict[int, str] = {}

    def text(token_id: int) -> str:
        found = cache.get(token_id)
        if found is None:
            if tokenizer is None:
                found = f"token_id:{token_id}"
            else:
                found = tokenizer.decode([token_id], skip_special_tokens=False)
            if len(cache) < 1_000_000:
                cache[token_id] = found
        return found

    return text
