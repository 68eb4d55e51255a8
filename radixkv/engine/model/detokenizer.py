"""Incremental detokenisation for streaming.

Decoding token by token splits multi-byte characters (a byte-level BPE token may hold half of an
emoji) and loses the leading-space rules of SentencePiece. Two ways around it, both emitting only
text past what was emitted before and holding back an incomplete UTF-8 sequence:

* the `tokenizers` library's `DecodeStream` (Rust, constant work per token), as vLLM's fast
  detokenizer uses it, for every tokenizer backed by that library whose `decode` adds nothing on
  top of it (no `clean_up_tokenization_spaces`);
* otherwise, like vLLM's and TGI's slow path, decoding a short window that starts a few tokens
  back and emitting the text past what the window's prefix decodes to.

Both give the text of `tokenizer.decode(ids, skip_special_tokens=True)`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"


def decode(tokenizer: Any | None, token_ids: Sequence[int]) -> str:
    """The text of `token_ids` without special tokens; "" without a tokenizer."""
    if tokenizer is None:
        return ""
    return tokenizer.decode(list(token_ids), skip_special_tokens=True)


def _decode_stream(tokenizer: Any | None) -> tuple[Any, Any] | None:
    """(a fresh DecodeStream, the Rust tokenizer it steps) when `tokenizer` decodes exactly as
    its `tokenizers` backend does; None otherwise."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream
    except ImportError:  # tokenizers < 0.21
        return None
    if not isinstance(backend, Tokenizer):
        return None
    return DecodeStream(skip_special_tokens=True), backend


class IncrementalDetokenizer:
    """Feed generated token ids with `push`; it returns the newly completed text.

    Invariant: `emitted` (the concatenation of all returned deltas) is a prefix of
    `decode(token_ids)`; `finish()` returns whatever remains but an incomplete last character.
    """

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.emitted = ""
        self._stream = _decode_stream(tokenizer)
        self._full_decode = False  # after a DecodeStream error: diff full decodes from then on
        self._prefix_offset = 0  # window start: context for spacing rules
        self._read_offset = 0  # tokens before this have been emitted as text

    def push(self, new_ids: Sequence[int]) -> str:
        self.token_ids.extend(new_ids)
        if not new_ids:
            return ""
        if self._stream is not None:
            delta = self._push_stream(new_ids)
        elif self._full_decode:
            delta = self._push_full()
        else:
            delta = self._push_window()
        self.emitted += delta
        return delta

    def finish(self) -> str:
        """The rest of the full decode, less a character left incomplete at the end: a reply cut
        in the middle of one (by max_tokens, say) ends before it, not in a U+FFFD no one wrote."""
        full = decode(self.tokenizer, self.token_ids)
        # Should the incremental decode ever disagree with the full one, never re-emit text.
        rest = full[len(self.emitted) :] if full.startswith(self.emitted) else ""
        rest = rest.rstrip(_REPLACEMENT)
        self.emitted += rest
        return rest

    def _push_stream(self, new_ids: Sequence[int]) -> str:
        assert self._stream is not None
        stream, backend = self._stream
        pieces = []
        try:
            for token in new_ids:
                piece = stream.step(backend, token)
                if piece:
                    pieces.append(piece)
        except Exception as exc:  # e.g. "invalid prefix": the stream lost its place
            logger.debug("DecodeStream failed (%r); decoding the whole text from now on", exc)
            self._stream, self._full_decode = None, True
            return self._push_full()
        return "".join(pieces)

    def _push_full(self) -> str:
        full = decode(self.tokenizer, self.token_ids)
        if not full.startswith(self.emitted) or full.endswith(_REPLACEMENT):
            return ""
        return full[len(self.emitted) :]

    def _push_window(self) -> str:
        window = self.token_ids[self._prefix_offset :]
        prefix_text = decode(self.tokenizer, window[: self._read_offset - self._prefix_offset])
        window_text = decode(self.tokenizer, window)
        if len(window_text) <= len(prefix_text) or window_text.endswith(_REPLACEMENT):
            return ""  # nothing new, or a character still incomplete: wait for more tokens
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return window_text[len(prefix_text) :]
