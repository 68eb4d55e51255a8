"""Incremental detokenisation for streaming.

Decoding token by token splits multi-byte characters (a byte-level BPE token may hold half of an
emoji) and loses the leading-space rules of SentencePiece. So, like vLLM and TGI, decode a short
window that starts a few tokens back and emit only the text past what the window's prefix decodes
to, holding back while the text ends in U+FFFD (an incomplete UTF-8 sequence).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT = "\ufffd"


def decode(tokenizer: Any | None, token_ids: Sequence[int]) -> str:
    """The text of `token_ids` without special tokens; "" without a tokenizer."""
    if tokenizer is None:
        return ""
    return tokenizer.decode(list(token_ids), skip_special_tokens=True)


class IncrementalDetokenizer:
    """Feed generated token ids with `push`; it returns the newly completed text.

    Invariant: `emitted` (the concatenation of all returned deltas) is a prefix of
    `decode(token_ids)` once no character is pending; `finish()` returns whatever remains.
    """

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.emitted = ""
        self._prefix_offset = 0  # window start: context for spacing rules
        self._read_offset = 0  # tokens before this have been emitted as text

    def push(self, new_ids: Sequence[int]) -> str:
        self.token_ids.extend(new_ids)
        if not new_ids:
            return ""
        window = self.token_ids[self._prefix_offset :]
        prefix_text = decode(self.tokenizer, window[: self._read_offset - self._prefix_offset])
        window_text = decode(self.tokenizer, window)
        if len(window_text) <= len(prefix_text) or window_text.endswith(_REPLACEMENT):
            return ""  # nothing new, or a character still incomplete: wait for more tokens
        delta = window_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self.emitted += delta
        return delta

    def finish(self) -> str:
        """The rest of the full decode (e.g. a dangling incomplete character at the end)."""
        full = decode(self.tokenizer, self.token_ids)
        # Should the windowed decode ever disagree with the full one, never re-emit text.
        rest = full[len(self.emitted) :] if full.startswith(self.emitted) else ""
        self.emitted += rest
        return rest
