"""Stop strings: the engine stops on token ids; the server cuts the text at a stop string."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Feed generated text with `push`; it returns the text that is safe to send.

    Text that might be the start of a stop string is held back until the next push shows it is
    not. Once a stop string is found, `stopped` is True and the text from it on is dropped (as
    OpenAI does: the stop string is not part of the reply).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self._stops:
            return text
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return buf[: min(hits)]
        keep = self._longest_stop_prefix_suffix(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The held-back text, when generation ended without a stop string."""
        out, self._held = self._held, ""
        return out

    def _longest_stop_prefix_suffix(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best
