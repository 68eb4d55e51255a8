"""A model's text in and out: prompts to token ids, chat messages through the template, ids back
to text. One home for both holders of a tokenizer: `LLM` and the server's front end (which, with
the engine in a process of its own, tokenizes and detokenizes without the model)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from radixkv.engine.model.chat_template import encode_chat
from radixkv.engine.model.detokenizer import decode
from radixkv.engine.model.prompts import check_chat_messages


@dataclass(frozen=True, slots=True)
class ModelText:
    """The text functions of one tokenizer (None: a model without one, whose prompts are token
    ids). `parse_special_tokens` is the engine's `parse_special_tokens_in_content`."""

    tokenizer: Any | None
    model_name: str
    parse_special_tokens: bool = False

    def encode(self, text: str) -> list[int]:
        """Tokenize a string prompt; ValueError without a tokenizer."""
        if self.tokenizer is None:
            raise ValueError(
                f"model {self.model_name!r} has no tokenizer: pass prompts as token-id lists"
            )
        return list(self.tokenizer.encode(text))

    @property
    def has_chat_template(self) -> bool:
        """Whether the model has a tokenizer with a chat template (what `encode_chat` needs)."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> list[int]:
        """The prompt of a chat: `messages` (and `tools`, OpenAI's tool definitions, for a
        template that renders them) through the tokenizer's chat template, with the
        assistant's turn opened; special-token text in their content is plain text unless
        `parse_special_tokens` (see `chat_template.py`). Raises ValueError for a model without
        a tokenizer or chat template, a message without a string role and content (TypeError:
        not a dict, or a role or content of another type), or messages the template refuses."""
        if not self.has_chat_template:
            raise ValueError(f"model {self.model_name!r} has no chat template")
        checked = check_chat_messages(messages)
        return encode_chat(
            self.tokenizer, checked, parse_special_tokens=self.parse_special_tokens, tools=tools
        )

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of `token_ids` without special tokens; "" without a tokenizer."""
        return decode(self.tokenizer, token_ids)
