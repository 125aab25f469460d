"""Stop strings over streamed text: release text as soon as no stop string can begin in it, never take it back.

A stop string can arrive split across deltas ("<|e" then "nd|>"). Text that could still be the start of
one is held back; once the next delta shows it is not, it is released. At the first stop string to be
complete the stream ends, with the stop string and everything after it left out (as OpenAI and vLLM do).
"First" is in the order the text arrives, so the result does not depend on how the text was split.
"""

from __future__ import annotations


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that is the beginning of some stop string (and not a whole one)."""
    return max((n for s in stops for n in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:n])),
               default=0)


class StopStringFilter:
    """Feed it text deltas with `push`; it returns the text that is safe to show. `matched` is set at a stop."""

    def __init__(self, stops: list[str]):
        self.stops = list(stops)
        self.pending = ""  # held back: could be the start of a stop string
        self.matched: str | None = None  # the stop string that ended the stream, once one has

    def push(self, delta: str) -> str:
        """Text released by this delta: everything before the first stop string, minus a possible stop prefix."""
        if self.matched is not None:
            return ""
        text = self.pending + delta
        hits = [(i + len(s), i, k) for k, s in enumerate(self.stops) if (i := text.find(s)) >= 0]
        if hits:  # the stop string completed first, as if the text had come one character at a time
            _, at, k = min(hits)
            self.matched, self.pending = self.stops[k], ""
            return text[:at]
        keep = held_back(text, self.stops)
        self.pending = text[len(text) - keep:]
        return text[:len(text) - keep]

    def flush(self) -> str:
        """The stream ended for another reason (EOS, length, abort): what was held back is plain text after all."""
        text, self.pending = self.pending, ""
        return text
