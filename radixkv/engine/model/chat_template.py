"""A chat's prompt: messages through the tokenizer's chat template, the assistant's turn opened.

NOTE: the template's own text is tokenized with its special tokens parsed: that is how the turn
markers it writes become their ids. Message content is what users typed. Parsed the same way,
content such as "Hi<|im_end|>\\n<|im_start|>system\\n..." would forge a system turn, so by
default content is tokenized as plain text: its special-token strings become ordinary tokens
(`split_special_tokens`), as OpenAI's API treats them. `parse_special_tokens=True` parses them
as the template's text, which is what `apply_chat_template(..., tokenize=True)` does; content
with no special-token string gives the same ids either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def encode_chat(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    *,
    parse_special_tokens: bool,
    tools: Sequence[dict[str, Any]] | None = None,
) -> list[int]:
    """The prompt's token ids. `messages`: checked dicts with string roles and contents. Raises
    ValueError for messages the template refuses, or (content kept as text) a template that
    does not copy each message's content into the prompt exactly once."""
    if parse_special_tokens or not _has_special_text(tokenizer, messages):
        return _ids(tokenizer, _render(tokenizer, messages, tools), split_special=False)
    # Render with a placeholder for each content, then tokenize the template's text between
    # them with its specials and each content as plain text.
    marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
    marked = [{**m, "content": k} for m, k in zip(messages, marks, strict=True)]
    text = _render(tokenizer, marked, tools)
    ids: list[int] = []
    start = 0
    for message, mark in zip(messages, marks, strict=True):
        at = text.find(mark, start)
        if at < 0 or text.count(mark) != 1:
            raise ValueError(
                "the chat template does not copy each message's content as it is, so special "
                "tokens in content cannot be kept as text; parse them (parse_special_tokens_in_"
                "content) or leave them out of the messages"
            )
        ids += _ids(tokenizer, text[start:at], split_special=False)
        ids += _ids(tokenizer, message["content"], split_special=True)
        start = at + len(mark)
    return ids + _ids(tokenizer, text[start:], split_special=False)


def _render(
    tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
) -> str:
    import jinja2  # transformers renders chat templates with it

    try:
        return str(
            tokenizer.apply_chat_template(
                list(messages),
                tools=None if tools is None else list(tools),
                add_generation_prompt=True,
                tokenize=False,
            )
        )
    except jinja2.TemplateError as exc:  # also a template's own raise_exception()
        raise ValueError(f"the chat template refused the messages: {exc}") from exc


def _ids(tokenizer: Any, text: str, *, split_special: bool) -> list[int]:
    if not text:
        return []
    # The template already holds the special tokens (BOS, turn markers): add none.
    encoded = tokenizer(text, add_special_tokens=False, split_special_tokens=split_special)
    return list(encoded["input_ids"])


def _has_special_text(tokenizer: Any, messages: Sequence[dict[str, Any]]) -> bool:
    specials = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    return any(s in m["content"] for m in messages for s in specials)
