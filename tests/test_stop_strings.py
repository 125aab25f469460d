"""Stop strings over streamed deltas: the released text is exactly the text before the first stop string,
whatever the split, and nothing released is ever taken back."""

import string

from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.stop_strings import StopStringFilter, held_back

ALPHABET = "ab<|>é\n "


def expected(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Read one character at a time: cut at the first stop string to be complete, and name it."""
    for end in range(len(text) + 1):
        ending = [(-len(s), k) for k, s in enumerate(stops) if text[:end].endswith(s)]
        if ending:
            longest, k = min(ending)  # several end here: the one that began first
            return text[:end + longest], stops[k]
    return text, None


def stream(deltas: list[str], stops: list[str]) -> tuple[list[str], str | None]:
    f = StopStringFilter(stops)
    released = [f.push(d) for d in deltas]
    if f.matched is None:
        released.append(f.flush())
    return released, f.matched


@settings(max_examples=400, deadline=None)
@given(st.text(ALPHABET, max_size=40), st.lists(st.text(ALPHABET, min_size=1, max_size=5), max_size=4),
       st.lists(st.integers(0, 40), max_size=12))
def test_any_split_releases_exactly_the_text_before_the_first_stop(text, stops, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    released, matched = stream(deltas, stops)
    assert ("".join(released), matched) == expected(text, stops)


@settings(max_examples=200, deadline=None)
@given(st.text(ALPHABET, max_size=30), st.lists(st.text(ALPHABET, min_size=1, max_size=5), min_size=1, max_size=3))
def test_text_is_released_as_soon_as_no_stop_string_can_begin_in_it(text, stops):
    """One character at a time: what is held back is only ever a possible start of a stop string."""
    f = StopStringFilter(stops)
    seen = ""
    for ch in text:
        seen += ch
        f.push(ch)
        if f.matched is not None:
            break
        assert len(f.pending) == held_back(seen, stops)
        assert all(not any(s.startswith(seen[i:]) for s in stops) for i in range(len(seen) - len(f.pending)))


def test_split_stop_string_is_held_then_dropped():
    f = StopStringFilter(["<|end|>"])
    assert [f.push(d) for d in ["Hello <", "|e", "nd", "|> more"]] == ["Hello ", "", "", ""]
    assert f.matched == "<|end|>"


def test_false_start_is_released_when_it_cannot_be_a_stop():
    f = StopStringFilter(["<|end|>"])
    assert [f.push(d) for d in ["a <|e", "x"]] == ["a ", "<|ex"]
    assert f.matched is None and f.flush() == ""


def test_the_first_stop_to_complete_wins_whatever_the_order_listed():
    assert stream(["xxbyyaz"], ["a", "b"]) == (["xx"], "b")
    assert stream(["xxab"], ["ab", "a"]) == (["xx"], "a")
    assert stream(["><<"], ["><<", "<"]) == ([">"], "<")
    assert stream(["><", "<"], ["><<", "<"]) == ([">", ""], "<")  # "<" is complete before "><<" could be


def test_flush_releases_a_held_prefix_at_the_end():
    assert stream(["the end <|"], ["<|end|>"]) == (["the end ", "<|"], None)
    assert stream(list(string.ascii_lowercase), []) == (list(string.ascii_lowercase) + [""], None)
