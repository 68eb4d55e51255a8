"""StopStringMatcher against the plain rule: the reply is the text up to the first stop string,
however the text is split into pushes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from radixkv.serve.stop_strings import StopStringMatcher

ALPHABET = "abc "


def reference(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


@given(
    chunks=st.lists(st.text(ALPHABET, max_size=5), max_size=12),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=3),
)
def test_pushes_give_the_text_up_to_the_first_stop_string(chunks, stops) -> None:
    matcher = StopStringMatcher(stops)
    out = "".join(matcher.push(c) for c in chunks)
    stopped = matcher.stopped
    out += matcher.flush()
    assert (out, stopped) == reference("".join(chunks), stops)


def test_text_that_may_start_a_stop_string_is_held_back() -> None:
    matcher = StopStringMatcher(["</end>"])
    assert matcher.push("hello </e") == "hello "
    assert matcher.push("x") == "</ex"
    assert matcher.push(" </en") == " "
    assert matcher.push("d> more") == ""
    assert matcher.stopped
    assert matcher.flush() == ""
