"""Chapter 8 — incremental detokenization: each step decodes a few recent tokens, not the whole output again.

Decoding the whole output after every token costs O(n) per step and O(n^2) per request. Instead each
sequence keeps two offsets into its output tokens: text up to `read_offset` is already emitted, and
`prefix_offset` starts a short window of earlier tokens decoded with the new ones. The new text is what
the window decodes to beyond its old part; the window gives tokenizers whose text depends on the token
before (SentencePiece's leading spaces) that context. A decode ending in U+FFFD means the new tokens end
inside a multi-byte character, so nothing is emitted until the character is complete.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"  # what a tokenizer's decode gives for an unfinished UTF-8 sequence


def detokenize_incrementally(tokenizer, token_ids: list[int], prefix_offset: int, read_offset: int,
                             final: bool = False, skip_special_tokens: bool = True) -> tuple[str, int, int]:
    """Text of `token_ids[read_offset:]` and the new (prefix_offset, read_offset).

    With `final`, an unfinished character is emitted as U+FFFD (as a full decode would) rather than held back.
    Special tokens (EOS, chat markers) have no text unless `skip_special_tokens` is False.
    """
    if read_offset >= len(token_ids):
        return "", prefix_offset, read_offset
    old = tokenizer.decode(token_ids[prefix_offset:read_offset], skip_special_tokens=skip_special_tokens)
    new = tokenizer.decode(token_ids[prefix_offset:], skip_special_tokens=skip_special_tokens)
    if not final and (len(new) < len(old) or new.endswith(REPLACEMENT)):
        return "", prefix_offset, read_offset  # a character still incomplete: wait for its last byte
    if len(new) == len(old):  # only skipped special tokens: keep the window's text tokens as context
        return "", prefix_offset, len(token_ids)
    return new[len(old):], read_offset, len(token_ids)
