"""Exercise 8 — stop strings over streamed text: show text as soon as it is safe, never take it back.

Replace each `raise NotImplementedError(...)` with your code, then run `make grade CH=08`.
Plain Python is enough; do not import minillm.stop_strings (that is what you are rebuilding).

A server streams a completion as text deltas, one per decode step ("Hel", "lo <", "|e", "nd|>", ...), and
the request may name stop strings (`stop=["<|end|>"]`): the completion ends where one appears, and the
stop string and everything after it are left out, as OpenAI's API and vLLM do. A client reading the
stream (Server-Sent Events) prints each piece as it arrives and has no way to take text back. So:

1. Hold back text that could still be the start of a stop string ("<|e" could become "<|end|>"), and
   release it as soon as it cannot ("<|e" then "x": release "<|ex"). Release everything else at once.
2. Never release text that later turns out to be part of a stop string or to come after one.
3. The stream ends at the first stop string to be *complete*, reading the text one character at a
   time, so the result does not depend on how the text was split into deltas. If several complete at
   the same character, the one that began first (the longest) wins; then the first in the list.
   Example: stops ["xyz", "y"] on "axyz" end at "y" (complete at the third character), releasing "ax".
4. After the stop, every push releases "" (the stream is over).
5. If the stream ends for another reason (end of sequence, length limit), `flush` releases what was
   held back: it was plain text after all.

Stop strings are non-empty. Deltas may be empty, and may hold several characters or none of a stop
string; text is Python `str`, so multi-byte characters and emoji are single characters here.
"""

from __future__ import annotations


def held_back(text: str, stops: list[str]) -> int:
    """How many characters at the end of `text` must be held back: the length of the longest end of `text`
    that is the beginning of some stop string without being the whole of it (0 if none).

    held_back("Hello <|e", ["<|end|>"]) == 3; held_back("xaa", ["aab"]) == 2; held_back("ab", ["b"]) == 0.
    """
    raise NotImplementedError("held_back: write this function")


class StopStringFilter:
    """Feed it the deltas of one completion with `push`; it returns the text that is safe to show.

    Attributes:
        pending   the text held back so far (could still be the start of a stop string); "" after a stop
        matched   the stop string that ended the stream, or None while none has
    """

    def __init__(self, stops: list[str]):
        """Start a stream with these stop strings: nothing pending, nothing matched."""
        raise NotImplementedError("StopStringFilter.__init__: write this method")

    def push(self, delta: str) -> str:
        """The text this delta releases: all text before the first complete stop string, minus what must
        still be held back; "" once a stop string has matched. Sets `pending` and `matched`."""
        raise NotImplementedError("StopStringFilter.push: write this method")

    def flush(self) -> str:
        """The stream ended for another reason: release the held-back text (and hold nothing any more)."""
        raise NotImplementedError("StopStringFilter.flush: write this method")
