"""Stop strings over streamed deltas: the released text is exactly the text before the first stop string,
whatever the split, and nothing released is ever taken back."""

import string

from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.stop_strings import StopAutomaton, StopStringFilter, held_back

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


def held_back_by_definition(text: str, stops: list[str]) -> int:
    return max((n for s in stops for n in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:n])), default=0)


@settings(max_examples=300, deadline=None)
@given(st.text(ALPHABET, max_size=30), st.lists(st.text(ALPHABET, min_size=1, max_size=5), max_size=4))
def test_held_back_is_the_longest_end_that_begins_a_stop(text, stops):
    assert held_back(text, stops) == held_back_by_definition(text, stops)


@settings(max_examples=200, deadline=None)
@given(st.text(ALPHABET, max_size=30), st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=4),
       st.integers(0, 30), st.lists(st.integers(0, 30), max_size=6))
def test_no_stop_ends_before_min_tokens_text_but_one_begun_there_can_end_after(text, stops, cut, cuts):
    """push(match=False) for the first `cut` characters (min_tokens' text), then as usual."""
    cut = min(cut, len(text))
    bounds = sorted({cut, len(text), *(c for c in cuts if cut <= c <= len(text))})
    f = StopStringFilter(stops)
    released = f.push(text[:cut], match=False)
    assert len(f.pending) == held_back_by_definition(text[:cut], stops)
    released += "".join(f.push(text[a:b]) for a, b in zip(bounds, bounds[1:]))
    if f.matched is None:
        released += f.flush()
    first = next(((end, -len(s), k) for end in range(cut + 1, len(text) + 1)
                  for k, s in enumerate(stops) if text[:end].endswith(s)), None)
    ends = [(-len(s), k) for k, s in enumerate(stops) if first and text[:first[0]].endswith(s)]
    if first is None:
        assert (released, f.matched) == (text, None)
    else:
        longest, k = min(ends)
        assert (released, f.matched) == (text[:first[0] + longest], stops[k])


class CountingGoto(dict):
    """The automaton's transition table, counting lookups: the work done per character."""

    lookups = 0

    def get(self, key, default=None):
        CountingGoto.lookups += 1
        return super().get(key, default)


def lookups_per_character(stops: list[str], text: str) -> float:
    automaton = StopAutomaton(stops)
    automaton.goto = CountingGoto(automaton.goto)
    CountingGoto.lookups = 0
    f = StopStringFilter(automaton)
    for i in range(0, len(text), 3):
        f.push(text[i:i + 3], match=False)  # keep going past matches: every character is read
    return CountingGoto.lookups / len(text)


def test_work_per_character_does_not_grow_with_the_number_of_stops():
    letters = "abcd"
    text = "".join(letters[(i * i + i // 7) % 4] for i in range(3000)) + "a" * 500
    for count in (1, 10, 100, 1000, 100_000):
        stops = ["aaaab"] + ["".join(letters[(k >> (2 * j)) % 4] for j in range(8)) for k in range(count)]
        assert lookups_per_character(stops, text) <= 2  # one transition, plus failure links paid for by depth


def test_two_hundred_thousand_stops():
    alphabet = "abcdefghijklmnopqrst"
    stops = ["".join(alphabet[(k // 20 ** j) % 20] for j in range(5)) for k in range(200_000)]
    automaton = StopAutomaton(stops)  # once per request: the n completions share it
    filters = [StopStringFilter(automaton) for _ in range(4)]
    text = "zz uvw xyz! " * 300 + "ab " + "abcdx" + " so far, " + "jihga" + " more text"
    for f in filters:
        released = "".join(f.push(text[i:i + 4]) for i in range(0, len(text), 4))
        assert (released, f.matched) == (text[:text.index("jihga")], "jihga")
    other = StopStringFilter(automaton)
    assert (other.push("no stop here"), other.pending) == ("no stop ", "here")  # "here" may begin a stop
    assert other.flush() == "here" and other.matched is None
