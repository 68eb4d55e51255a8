"""Multi-turn chat on top of `LLM`, shaped so that every turn hits the prefix cache.

Each `send()` renders the model's chat template over the whole history with
`add_generation_prompt=True`. The reply's text goes back into the history, so turn n+1's prompt is
turn n's prompt + reply tokens + the new user turn, as long as the template re-renders the
assistant turn with the tokens the model produced. For ChatML (SmolLM2) it does: the reply ends
with the sampled `<|im_end|>`, which the template writes back. The one token of the previous turn
the cache cannot serve is that last sampled token, whose KV was never computed.

When the next prompt would leave no room for a reply in the model's context, the oldest
user/assistant turns are dropped (the system message stays) until it fits; `dropped_turns` says
how many the last turn dropped. The cache then serves only the system prompt for that turn.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

from radixkv.cache.tokens import common_prefix_len
from radixkv.engine import LLM, ModelLoadError
from radixkv.engine.outputs import RequestOutput, RequestStats, StreamDelta
from radixkv.engine.sampling_params import SamplingParams

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
    a failed or interrupted turn leaves it unchanged (its message and partial reply are dropped).
    Raises ModelLoadError (a ValueError) when the model has no tokenizer or no chat template.
    """

    def __init__(
        self, llm: LLM, system: str | None = None, params: SamplingParams | None = None
    ) -> None:
        if llm.tokenizer is None:
            raise ModelLoadError(f"model {llm.model_name!r} has no tokenizer; a chat needs one")
        if not llm.has_chat_template:
            raise ModelLoadError(f"model {llm.model_name!r} has no chat template; a chat needs one")
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
        self.dropped_turns = 0  # oldest turns the last turn dropped to fit the context

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
        self.dropped_turns = 0

    def prompt_token_ids(self, message: str) -> list[int]:
        """Token ids of the prompt `send(message)` would generate from (with the whole history;
        see `_fit` for the context limit). Raises TypeError / ValueError for a message that is
        not a str, is empty, or is not valid UTF-8 text (e.g. undecodable input bytes)."""
        return self._render(self._history, message)

    def _render(self, turns: list[dict[str, str]], message: str) -> list[int]:
        if not isinstance(message, str):
            raise TypeError(f"message must be a str, got {type(message).__name__}")
        if not message.strip():
            raise ValueError("message must not be empty")
        try:
            message.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"message is not valid UTF-8 text (undecodable byte at position {exc.start})"
            ) from None
        head = [{"role": "system", "content": self.system}] if self.system is not None else []
        messages = [*head, *turns, {"role": "user", "content": message}]
        return self.llm.encode_chat(messages)

    def _fit(self, message: str, params: SamplingParams) -> tuple[list[int], int]:
        """The prompt for `message` and how many of the oldest turns it drops so that a reply of
        `params.max_tokens` tokens (at most half the context) still fits. With every turn dropped
        the prompt may still be too long: the engine then rejects it (ValueError)."""
        context = self.llm.config.max_model_len
        room = min(params.max_tokens, context // 2)
        num_turns = len(self._history) // 2
        for dropped in range(num_turns + 1):
            prompt = self._render(self._history[2 * dropped :], message)
            if len(prompt) + room <= context:
                return prompt, dropped
        return prompt, num_turns

    def send(self, message: str, params: SamplingParams | None = None) -> ChatReply:
        """Generate the assistant's reply to `message` and append both to the history."""
        params = params or self.params
        prompt, dropped = self._prepare(message, params)
        (out,) = self.llm.generate([prompt], params)
        return self._record(message, prompt, dropped, out)

    def stream(self, message: str, params: SamplingParams | None = None) -> Iterator[str]:
        """Like send(), yielding the reply's text as it is produced; `last_reply` holds the whole
        reply once the iterator is exhausted. Validation errors are raised by this call. Closing
        the iterator early (or an exception, KeyboardInterrupt included) aborts the reply and
        leaves the history unchanged."""
        params = params or self.params
        prompt, dropped = self._prepare(message, params)
        deltas = self.llm.stream(prompt, params)
        return self._stream(message, prompt, dropped, deltas)

    def _stream(
        self, message: str, prompt: list[int], dropped: int, deltas: Iterator[StreamDelta]
    ) -> Iterator[str]:
        try:
            for delta in deltas:
                if delta.text:
                    yield delta.text
                if delta.output is not None:
                    self._record(message, prompt, dropped, delta.output)
        finally:
            close = getattr(deltas, "close", None)
            if close is not None:
                close()

    def _prepare(self, message: str, params: SamplingParams) -> tuple[list[int], int]:
        prompt, dropped = self._fit(message, params)
        if self._last_tokens:
            n = common_prefix_len(prompt, self._last_tokens)
            self.num_reused_tokens = n
            if n < len(self._last_tokens) and not dropped:
                # The template re-rendered the previous reply with different tokens (e.g. a
                # non-canonical tokenization, or no end-of-turn token after a length stop).
                logger.debug(
                    "chat prompt keeps %d of the previous %d prompt + reply tokens",
                    n,
                    len(self._last_tokens),
                )
        return prompt, dropped

    def _record(
        self, message: str, prompt: list[int], dropped: int, out: RequestOutput
    ) -> ChatReply:
        turn = [{"role": "user", "content": message}, {"role": "assistant", "content": out.text}]
        # One assignment: an interrupt never leaves half a turn in the history.
        self._history = [*self._history[2 * dropped :], *turn]
        self.dropped_turns = dropped
        self._last_tokens = [*prompt, *out.token_ids]
        reply = ChatReply(out.text, tuple(out.token_ids), out.stats, out.finish_reason)
        self.last_reply = reply
        return reply
