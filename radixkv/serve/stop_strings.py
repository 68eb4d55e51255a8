"""Stop strings: the engine stops on token ids; the server cuts the text at a stop string."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class StopStringMatcher:
    """Feed generated text with `push`; it returns the text that is safe to send.

    The reply ends at the first stop string to complete (the earliest end; of those ending there,
    the longest), however the text is split into pushes. Text that might be the start of a stop
    string is held back until a later push shows it is not. Once a stop string is found,
    `stopped` is True and the text from it on is dropped (as OpenAI does: the stop string is not
    part of the reply).

    An Aho-Corasick automaton over the stop strings' characters, built once (time and memory
    linear in their total length): each pushed character costs O(1) amortised, however many stop
    strings there are. The automaton's state after the text so far is the longest suffix of the
    text that is a prefix of a stop string: exactly the text to hold back.

    `min_tokens` (vLLM's rule): a stop string that completes in the text of the reply's first
    `min_tokens` tokens does not stop it; one that completes later does, even if it began
    before. Each push says how many tokens its text came from.
    """

    def __init__(self, stops: Sequence[str], min_tokens: int = 0) -> None:
        # State 0 is the root (the empty prefix); each other state is one prefix of a stop string.
        self._next: list[dict[str, int]] = [{}]
        self._depth = [0]  # the prefix's length
        self._fail = [0]  # the state of the prefix's longest proper suffix that is a prefix too
        self._stop_len = [0]  # the longest stop string that is a suffix of the prefix (0: none)
        for stop in stops:
            if stop:
                self._add(stop)
        self._link()
        self._state = 0
        self._held = ""
        self.stopped = False
        self._min_tokens = min_tokens
        self._num_tokens = 0  # pushed so far
        # Once stopped: characters of the last push's text up to the stop string's end (what
        # a push of several tokens bills; 0 when the stop string ended in earlier text).
        self.stop_end = 0

    def push(self, text: str, num_tokens: int = 1) -> str:
        """`text`, the decoded text of the reply's next `num_tokens` tokens; returns the text
        that is safe to send."""
        if self.stopped:
            return ""
        self._num_tokens += num_tokens
        if len(self._next) == 1:  # no stop strings
            return text
        buf = self._held + text
        state = self._state
        may_stop = self._num_tokens > self._min_tokens
        for end in range(len(self._held) + 1, len(buf) + 1):
            state = self._step(state, buf[end - 1])
            if self._stop_len[state] and may_stop:
                self.stopped = True
                self.stop_end = max(0, end - len(self._held))
                self._held = ""
                return buf[: end - self._stop_len[state]]
        self._state = state
        keep = self._depth[state]
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The held-back text, when generation ended without a stop string."""
        out, self._held = self._held, ""
        return out

    def _step(self, state: int, char: str) -> int:
        while True:
            target = self._next[state].get(char)
            if target is not None:
                return target
            if state == 0:
                return 0
            state = self._fail[state]

    def _add(self, stop: str) -> None:
        state = 0
        for char in stop:
            target = self._next[state].get(char)
            if target is None:
                target = len(self._next)
                self._next.append({})
                self._depth.append(self._depth[state] + 1)
                self._fail.append(0)
                self._stop_len.append(0)
                self._next[state][char] = target
            state = target
        self._stop_len[state] = len(stop)

    def _link(self) -> None:
        """Failure links and stop lengths, breadth first (a state's links need its parent's)."""
        queue = deque(self._next[0].values())
        while queue:
            state = queue.popleft()
            for char, child in self._next[state].items():
                if state:
                    self._fail[child] = self._step(self._fail[state], char)
                if not self._stop_len[child]:
                    self._stop_len[child] = self._stop_len[self._fail[child]]
                queue.append(child)
