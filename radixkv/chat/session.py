"""Multi-turn chat on top of `LLM`, shaped so that every turn hits the prefix cache.

Each `send()` renders the model's chat template over the whole history with
`add_generation_prompt=True`. The reply's text goes back into the history, so turn n+1's prompt is
turn n's prompt + reply tokens + the new user turn, as long as the template re-renders the
assistant turn with the tokens the model produced. For ChatML (SmolLM2) it does: the reply ends
with the sampled `<|im_end|>`, which the template writes back. The one token of the previous turn
the cache cannot serve is that last sampled token, whose KV was never computed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from radixkv.cache.tokens import common_prefix_len
from radixkv.engine import LLM
from radixkv.engine.outputs import RequestStats, StreamDelta
from radixkv.scheduler.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ChatReply:
    text: str
    token_ids: tuple[int, ...]
    stats: RequestStats
    finish_reason: str = "stop"


class ChatSession:
    """A conversation with one model. Not thread-safe; one session per conversation.

    Invariant: `history` alternates user / assistant messages after an optional system message;
    a failed turn leaves it unchanged.
    """

    def __init__(
        self, llm: LLM, system: str | None = None, params: SamplingParams | None = None
    ) -> None:
        tokenizer = llm.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"model {llm.model_name!r} has no chat template")
        if system is not None and not isinstance(system, str):
            raise TypeError(f"system must be a str, got {type(system).__name__}")
        if params is not None and not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        self.llm = llm
        self.system = system
        self.params = params or SamplingParams(max_tokens=256)
        self.last_reply: ChatReply | None = None
        self._history: list[dict[str, str]] = []
        self._last_tokens: list[int] = []  # previous prompt + reply tokens
        self.num_reused_tokens = 0  # tokens of the previous prompt + reply this turn's prompt kept

    @property
    def history(self) -> list[dict[str, str]]:
        """The messages so far (a copy), system message first when there is one."""
        head = [{"role": "system", "content": self.system}] if self.system is not None else []
        return head + [dict(m) for m in self._history]

    def reset(self) -> None:
        """Forget the conversation (the cached prefixes stay in the engine's cache)."""
        self._history.clear()
        self._last_tokens = []
        self.last_reply = None
        self.num_reused_tokens = 0

    def prompt_token_ids(self, message: str) -> list[int]:
        """Token ids of the prompt `send(message)` would generate from."""
        if not isinstance(message, str):
            raise TypeError(f"message must be a str, got {type(message).__name__}")
        if not message.strip():
            raise ValueError("message must not be empty")
        messages = [*self.history, {"role": "user", "content": message}]
        text = self.llm.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        # The template already holds the special tokens (BOS, turn markers): add none.
        return list(self.llm.tokenizer(text, add_special_tokens=False)["input_ids"])

    def send(self, message: str, params: SamplingParams | None = None) -> ChatReply:
        """Generate the assistant's reply to `message` and append both to the history."""
        prompt = self._prepare(message)
        (out,) = self.llm.generate([prompt], params or self.params)
        return self._record(message, prompt, out.text, out.token_ids, out.finish_reason, out.stats)

    def stream(self, message: str, params: SamplingParams | None = None) -> Iterator[str]:
        """Like send(), yielding the reply's text as it is produced; `last_reply` holds the whole
        reply once the iterator is exhausted. Validation errors are raised by this call."""
        prompt = self._prepare(message)
        deltas = self.llm.stream(prompt, params or self.params)
        return self._stream(message, prompt, deltas)

    def _stream(
        self, message: str, prompt: list[int], deltas: Iterator[StreamDelta]
    ) -> Iterator[str]:
        for delta in deltas:
            if delta.text:
                yield delta.text
            if delta.output is not None:
                out = delta.output
                self._record(message, prompt, out.text, out.token_ids, out.finish_reason, out.stats)

    def _prepare(self, message: str) -> list[int]:
        prompt = self.prompt_token_ids(message)
        if self._last_tokens:
            n = common_prefix_len(prompt, self._last_tokens)
            self.num_reused_tokens = n
            if n < len(self._last_tokens):
                # The template re-rendered the previous reply with different tokens (e.g. a
                # non-canonical tokenization, or no end-of-turn token after a length stop).
                logger.debug(
                    "chat prompt keeps %d of the previous %d prompt + reply tokens",
                    n,
                    len(self._last_tokens),
                )
        return prompt

    def _record(
        self,
        message: str,
        prompt: list[int],
        text: str,
        token_ids: Sequence[int],
        finish_reason: str,
        stats: RequestStats,
    ) -> ChatReply:
        self._history.append({"role": "user", "content": message})
        self._history.append({"role": "assistant", "content": text})
        self._last_tokens = [*prompt, *token_ids]
        reply = ChatReply(text, tuple(token_ids), stats, finish_reason)
        self.last_reply = reply
        return reply
