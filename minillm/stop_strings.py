"""Chapter 8 — stop strings over streamed text: release text as soon as no stop string can begin in it, never
take it back.

A stop string can arrive split across deltas ("<|e" then "nd|>"). Text that could still be the start of
one is held back; once the next delta shows it is not, it is released. At the first stop string to be
complete the stream ends, with the stop string and everything after it left out (as OpenAI and vLLM do).
"First" is in the order the text arrives, so the result does not depend on how the text was split.

Checking every stop string against every delta would cost time in proportion to their number, inside the
engine step. Instead a request's stop strings are compiled once into an Aho–Corasick automaton over
characters, and each character costs one transition (amortized) however many stop strings there are. The
automaton's state is the longest end of the text that begins some stop string: how much to hold back is read
off the state, and a state where a stop string ends is a match. Compiling costs milliseconds for long stop
strings, so `compile_stops` keeps the last few automata: the prompts of a batch, and requests that send the
same stop strings, share one, and a server compiles it ahead, off its event loop.
"""

from __future__ import annotations

from functools import lru_cache

COMPILED_STOPS = 32  # automata kept by compile_stops (about 0.5 MB each at 16 stop strings of 256 characters)


class StopAutomaton:
    """Aho–Corasick automaton over the characters of some stop strings; never changed once built, so the n
    completions of a request share one.

    States are the trie's nodes (0 is the empty string). Per state: `fail`, the state of its longest proper
    end that is also a node; `match`, the index of the longest stop string it ends with (-1 if none); and
    `held`, the length of its longest end that begins a stop string without being a whole one.
    """

    def __init__(self, stops: list[str]):
        self.stops = list(stops)
        self.goto: dict[tuple[int, str], int] = {}  # trie edges: (state, character) -> next state
        edges, depth, ends = [(0, "")], [0], []  # per state: the edge into it and its length; per stop: its state
        for stop in self.stops:
            state = 0
            for ch in stop:
                if (to := self.goto.get(edge := (state, ch))) is None:
                    to = self.goto[edge] = len(edges)
                    edges.append(edge)
                    depth.append(depth[state] + 1)
                state = to
            ends.append(state)
        match, has_child = [-1] * len(edges), [False] * len(edges)
        for k in reversed(range(len(ends))):  # a repeated stop string keeps its first index
            match[ends[k]] = k
        for p, _ in edges[1:]:
            has_child[p] = True
        self.fail, self.held, self.match = [0] * len(edges), [0] * len(edges), match
        for state in sorted(range(1, len(edges)), key=depth.__getitem__):  # breadth first: shorter ends first
            p, ch = edges[state]
            if p:
                self.fail[state] = self.next(self.fail[p], ch)
            if match[state] < 0:
                match[state] = match[self.fail[state]]
            self.held[state] = depth[state] if has_child[state] else self.held[self.fail[state]]

    def next(self, state: int, ch: str) -> int:
        """The state after one more character: fall back along failure links until one can take `ch`."""
        while (to := self.goto.get((state, ch))) is None:
            if state == 0:
                return 0
            state = self.fail[state]
        return to


@lru_cache(maxsize=COMPILED_STOPS)
def compile_stops(stops: tuple[str, ...]) -> StopAutomaton:
    """The automaton of these stop strings, built once while it stays among the last few asked for."""
    return StopAutomaton(list(stops))


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that is the beginning of some stop string (and not a whole one)."""
    automaton, state = StopAutomaton(stops), 0
    for ch in text:
        state = automaton.next(state, ch)
    return automaton.held[state]


class StopStringFilter:
    """Feed it text deltas with `push`; it returns the text that is safe to show. `matched` is set at a stop.

    Built from a list of stop strings, or from a `StopAutomaton` already built for them (shared).
    """

    def __init__(self, stops: list[str] | StopAutomaton):
        self.automaton = stops if isinstance(stops, StopAutomaton) else StopAutomaton(stops)
        self.stops = self.automaton.stops
        self.state = 0  # the automaton's state after the text so far
        self.pending = ""  # held back: could be the start of a stop string
        self.matched: str | None = None  # the stop string that ended the stream, once one has

    def push(self, delta: str, match: bool = True) -> str:
        """Text released by this delta: everything before the first stop string, minus a possible stop prefix.

        With `match=False` no stop string ends the stream here (vLLM's min_tokens), but one that begins in
        this delta can still end in a later one.
        """
        if self.matched is not None:
            return ""
        text, a = self.pending + delta, self.automaton
        for end, ch in enumerate(delta, len(self.pending) + 1):
            self.state = a.next(self.state, ch)
            if match and a.match[self.state] >= 0:  # the longest stop ending here is the one that began first
                self.matched, self.pending = a.stops[a.match[self.state]], ""
                return text[:end - len(self.matched)]
        keep = a.held[self.state]
        self.pending = text[len(text) - keep:]
        return text[:len(text) - keep]

    def flush(self) -> str:
        """The stream ended for another reason (EOS, length, abort): what was held back is plain text after all."""
        text, self.pending, self.state = self.pending, "", 0
        return text
