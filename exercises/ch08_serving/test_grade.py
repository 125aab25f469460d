"""Grader for exercise 8: stop strings over streamed deltas, checked after every push against an oracle that
reads the text one character at a time (written here, so the grader does not lean on the code it grades)."""

from itertools import combinations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ALPHABET = "ab<|>é🙂 "


def oracle(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Read one character at a time; at the first stop string to be complete, cut before it and name it."""
    for end in range(1, len(text) + 1):
        complete = [s for s in stops if text[:end].endswith(s)]
        if complete:
            stop = max(complete, key=len)  # several end here: the one that began first (ties: list order)
            return text[:end - len(stop)], stop
    return text, None


def hold(text: str, stops: list[str]) -> int:
    """Length of the longest end of text that starts some stop string without being all of it."""
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


def check_stream(impl, deltas: list[str], stops: list[str]) -> None:
    """Push each delta; after each, the text shown (every piece released so far), `pending` and `matched` must
    be exactly what the oracle allows at that point. At the end, flush if no stop string matched."""
    f = impl.StopStringFilter(list(stops))
    final, _ = oracle("".join(deltas), stops)
    case = f"deltas {deltas!r}, stops {stops!r}"
    shown, seen = "", ""
    for i, delta in enumerate(deltas, 1):
        piece = f.push(delta)
        assert isinstance(piece, str), f"push #{i} returned {piece!r}, not a str; {case}"
        shown, seen = shown + piece, seen + delta
        assert final.startswith(shown), (f"shown {shown!r} after push #{i}, but the final text is {final!r}: "
                                         f"shown text cannot be taken back; {case}")
        text, stop = oracle(seen, stops)
        pending = "" if stop else seen[len(seen) - hold(seen, stops):]
        want = text if stop else seen[:len(seen) - len(pending)]
        assert shown == want, f"shown {shown!r} after push #{i}, expected {want!r}; {case}"
        assert f.pending == pending, f"pending {f.pending!r} after push #{i}, expected {pending!r}; {case}"
        assert f.matched == stop, f"matched {f.matched!r} after push #{i}, expected {stop!r}; {case}"
    if f.matched is None:
        tail = f.flush()
        assert shown + tail == final, f"flush() returned {tail!r}, expected {final[len(shown):]!r}; {case}"
        assert f.pending == "", f"pending {f.pending!r} after flush(), expected ''; {case}"


def splits(text: str, lo: int, hi: int) -> list[list[str]]:
    """Every way to cut `text` into deltas at positions lo..hi (both ends included)."""
    inner = range(max(lo, 1), min(hi, len(text) - 1) + 1)
    return [[text[a:b] for a, b in zip((0, *cuts), (*cuts, len(text)))]
            for k in range(len(inner) + 1) for cuts in combinations(inner, k)]


@pytest.mark.points(2)
def test_held_back(impl):
    cases = [("Hello <|e", ["<|end|>"], 3), ("Hello <", ["<|end|>"], 1), ("Hello", ["<|end|>"], 0),
             ("", ["<|end|>"], 0), ("abc", [], 0), ("xaa", ["aab"], 2), ("aa", ["aab", "ab"], 2),
             ("ab", ["b"], 0), ("ab", ["ab", "abc"], 2), ("a<|end|>", ["<|end|>"], 0), ("<<", ["<<<"], 2),
             ("x<", ["<|a", "x<|"], 2), ("naï", ["ïve"], 1), ("stop 🛑", ["🛑🛑"], 1), ("a", ["a"], 0),
             ("ba", ["ab", "abc"], 1), ("<|en", ["<|end|>", "en", "|en"], 4)]
    for text, stops, want in cases:
        got = impl.held_back(text, stops)
        assert got == want, f"held_back({text!r}, {stops!r}) = {got!r}, expected {want}"


@pytest.mark.points(1)
def test_stop_never_appears_and_flush_releases_the_tail(impl):
    check_stream(impl, ["Hello", ", world", "!"], ["<|end|>"])
    check_stream(impl, ["the end <", "|"], ["<|end|>"])  # held "<|" is plain text after all
    check_stream(impl, ["a", "b", "c"], [])
    check_stream(impl, ["abc"], ["abcd"])
    check_stream(impl, [], ["x"])


@pytest.mark.points(3)
def test_stop_string_split_across_deltas(impl):
    text, stops = "Hi <|end|> bye", ["<|end|>"]
    for deltas in splits(text, 3, 10):  # every split of the stop string into 1 to 7 pieces, with and without text
        check_stream(impl, deltas, stops)
    for deltas in splits("Hi <|end|>", 1, 9):
        check_stream(impl, deltas, ["<|end|>", "Hello"])


@pytest.mark.points(2)
def test_one_character_deltas(impl):
    cases = [("Hello <|end|> more", ["<|end|>"]), ("aaab", ["aab"]), ("abcabd", ["abd", "cab"]),
             ("<|<|e<|end|>", ["<|end|>"]), ("axyz", ["xyz", "y"]), ("no stop here", ["<|end|>", "zz"])]
    for text, stops in cases:
        check_stream(impl, list(text), stops)


@pytest.mark.points(2)
def test_false_starts_are_released(impl):
    check_stream(impl, ["a <|e", "x"], ["<|end|>"])  # "<|ex" cannot be a stop: released whole
    check_stream(impl, ["<|en", "d|", "x", "<|end|>"], ["<|end|>"])
    check_stream(impl, ["<|<|e", "n", "d|>"], ["<|end|>"])  # a false start holding a real one
    check_stream(impl, ["<", "<", "|", "e", "<", "|end|>"], ["<|end|>"])
    check_stream(impl, ["xa", "a", "c"], ["aab"])


@pytest.mark.points(2)
def test_overlapping_stops(impl):
    check_stream(impl, ["xab"], ["ab", "b"])  # both complete at "b": "ab" began first
    check_stream(impl, ["xab"], ["b", "ab"])
    check_stream(impl, ["x", "a", "b"], ["b", "ab"])
    check_stream(impl, ["aa", "b"], ["aab"])
    check_stream(impl, ["xaa", "ab"], ["aab"])  # the held "aa" slides: "xa" is released, then the stop
    check_stream(impl, ["aa", "a", "ab"], ["aab", "aaab"])


@pytest.mark.points(2)
def test_a_stop_string_that_starts_another(impl):
    check_stream(impl, ["xa", "b", "c"], ["abc", "ab"])  # "ab" is complete first: no waiting for "abc"
    check_stream(impl, ["xabc"], ["abc", "ab"])
    check_stream(impl, ["the end", "game"], ["endgame", "end"])
    check_stream(impl, ["><", "<"], ["><<", "<"])  # "<" (listed last) is complete before "><<" could be
    check_stream(impl, ["ax", "yz"], ["xyz", "y"])


@pytest.mark.points(2)
def test_several_stops_complete_in_one_delta(impl):
    check_stream(impl, ["xxbyyaz"], ["a", "b"])  # "b" arrives first, though listed second
    check_stream(impl, ["xxab"], ["ab", "a"])
    check_stream(impl, ["q", "<|im_end|><|endoftext|>"], ["<|endoftext|>", "<|im_end|>"])
    check_stream(impl, ["x", "abc"], ["c", "bc", "abc"])  # all end at "c": the longest began first
    check_stream(impl, ["x", "ab"], ["ab", "ab"])


@pytest.mark.points(1)
def test_multibyte_characters_and_emoji(impl):
    check_stream(impl, ["Ça va ", "🛑", " fin"], ["🛑"])
    check_stream(impl, ["naï", "ve 日", "本語"], ["日本"])
    check_stream(impl, ["ok 👍", "🏽 thanks"], ["👍🏽"])  # one emoji of two code points, split between them
    check_stream(impl, ["ok 👍", "!"], ["👍🏽"])
    check_stream(impl, list("é<🙂|é>"), ["<🙂|é>"])


@pytest.mark.points(1)
def test_empty_deltas(impl):
    check_stream(impl, ["", "Hi <|e", "", "nd", "", "|>", ""], ["<|end|>"])
    check_stream(impl, ["", "", "Hi <", "", ""], ["<|end|>"])
    check_stream(impl, [""], ["<|end|>"])


@pytest.mark.points(1)
def test_stop_at_the_very_start(impl):
    check_stream(impl, ["<|end|>"], ["<|end|>"])
    check_stream(impl, ["<|end|>and more"], ["<|end|>"])
    check_stream(impl, ["<|", "end|>", "x"], ["<|end|>"])


@pytest.mark.points(1)
def test_push_after_the_match_releases_nothing(impl):
    f = impl.StopStringFilter(["STOP", "x"])
    assert f.push("fooSTO") == "foo", "push('fooSTO') with stops ['STOP', 'x'] should release 'foo'"
    assert f.push("Pbar") == "", "the delta that completes 'STOP' releases nothing after 'foo'"
    for delta in ["more text", "x", "STOP", ""]:
        got = f.push(delta)
        assert got == "", f"push({delta!r}) after the stop returned {got!r}: the stream is over, release ''"
        assert f.matched == "STOP", f"matched changed to {f.matched!r} after the stop: it stays 'STOP'"
        assert f.pending == "", f"pending is {f.pending!r} after the stop, expected ''"
    assert f.flush() == "", "flush() after the stop must release nothing"


@pytest.mark.points(4)
@settings(max_examples=300, derandomize=True, database=None, deadline=None, report_multiple_bugs=False)
@given(text=st.text(ALPHABET, max_size=30), stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=4),
       cuts=st.lists(st.integers(0, 30), max_size=10))
def test_random_splits_match_the_oracle(impl, text, stops, cuts):
    bounds = sorted([0, len(text), *(c for c in cuts if c <= len(text))])  # repeated cuts make empty deltas
    check_stream(impl, [text[a:b] for a, b in zip(bounds, bounds[1:])], stops)
