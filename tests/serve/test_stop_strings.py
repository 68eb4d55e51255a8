"""StopStringMatcher against the plain rule: the reply ends where the first stop string to
complete starts (of those completing at the same character, the longest), however the text is
split into pushes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from radixkv.serve.stop_strings import StopStringMatcher

ALPHABET = "abc "


def reference(text: str, stops: list[str]) -> tuple[str, bool]:
    """Scan the text character by character, as it is generated."""
    stops = [s for s in stops if s]
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return text[: end - max(map(len, done))], True
    return text, False


def run(chunks: list[str], stops: list[str]) -> tuple[str, bool]:
    matcher = StopStringMatcher(stops)
    out = "".join(matcher.push(c) for c in chunks)
    stopped = matcher.stopped
    return out + matcher.flush(), stopped


@given(
    chunks=st.lists(st.text(ALPHABET, max_size=5), max_size=12),
    stops=st.lists(st.text(ALPHABET, min_size=0, max_size=5), max_size=8),
)
def test_pushes_give_the_text_up_to_the_first_stop_string(chunks, stops) -> None:
    assert run(chunks, stops) == reference("".join(chunks), stops)


def test_overlapping_stops_cut_where_the_first_to_complete_starts() -> None:
    # "b" completes first (at the 2nd character): the reply is "a", in one push or three.
    assert run(["aba"], ["aba", "b"]) == ("a", True)
    assert run(["a", "b", "a"], ["aba", "b"]) == ("a", True)
    # Both complete at the 3rd character: the longer one starts earlier.
    assert run(["abc"], ["bc", "abc"]) == ("", True)


def test_text_that_may_start_a_stop_string_is_held_back() -> None:
    matcher = StopStringMatcher(["</end>"])
    assert matcher.push("hello </e") == "hello "
    assert matcher.push("x") == "</ex"
    assert matcher.push(" </en") == " "
    assert matcher.push("d> more") == ""
    assert matcher.stopped
    assert matcher.flush() == ""


def test_many_long_stop_strings_and_non_ascii_text() -> None:
    stops = [f"stop-{i:03d}-" + "é" * 40 for i in range(64)]
    text = "naïve café " * 50 + stops[37] + " never sent"
    chunks = [text[i : i + 3] for i in range(0, len(text), 3)]
    assert run(chunks, stops) == ("naïve café " * 50, True)
    assert run(["no stop here ✓"], stops) == ("no stop here ✓", False)


def test_stop_strings_in_the_first_min_tokens_tokens_do_not_stop() -> None:
    """vLLM's rule: a stop string completing in the text of the first min_tokens tokens is
    text; one completing later stops the reply, even if it began before."""
    matcher = StopStringMatcher(["XY"], min_tokens=2)
    assert matcher.push("aX", 1) == "a"
    assert matcher.push("Yb", 1) == "XYb"  # completed at token 2: not past min_tokens
    assert not matcher.stopped
    assert matcher.push("X", 1) == ""  # held back: it may start a stop string
    assert matcher.push("Yc", 1) == ""  # token 4: stops, the held "X" dropped with it
    assert matcher.stopped
    straddling = StopStringMatcher(["XY"], min_tokens=1)
    assert straddling.push("aX", 1) + straddling.push("Y", 1) == "a"
    assert straddling.stopped
    several = StopStringMatcher(["XY"], min_tokens=2)  # one push of three tokens passes it
    assert several.push("aXY", 3) == "a" and several.stopped
