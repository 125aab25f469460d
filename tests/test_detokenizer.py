"""Incremental detokenization gives the same text as decoding the whole output at once, token by token."""

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from conftest import has_default_model
from minillm.detokenizer import detokenize_incrementally

TEXTS = ["Hello, world! It's a fine day... isn't it?", "KV 缓存让解码只算新的词元。", "emoji 🚀🧠 and é, ß, ø",
         "def f(x):\n    return x  # tabs\tand  double  spaces", " leading space and trailing ", "a" * 40]


def sentencepiece_like() -> PreTrainedTokenizerFast:
    """A small BPE with SentencePiece's conventions: Metaspace spaces (the first token's space is dropped on
    decode) and byte fallback (a character outside the vocabulary becomes one token per UTF-8 byte)."""
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    trained.train_from_iterator(TEXTS * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"]))
    state = json.loads(trained.to_str())["model"]
    vocab = dict(state["vocab"])
    for i in range(256):  # byte tokens are ordinary vocabulary entries, so skip_special_tokens keeps them
        vocab.setdefault(f"<0x{i:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(["<unk>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


def tokenizers():
    yield "sentencepiece-like", sentencepiece_like()
    if has_default_model():
        from minillm.weights import resolve_model

        yield "default", AutoTokenizer.from_pretrained(str(resolve_model(None)))


def stream(tokenizer, ids: list[int]) -> tuple[list[str], str]:
    """Feed `ids` one at a time; the text after each step, and after the final flush."""
    text, prefix, read, seen = "", 0, 0, []
    for n in range(1, len(ids) + 1):
        delta, prefix, read = detokenize_incrementally(tokenizer, ids[:n], prefix, read)
        text += delta
        seen.append(text)
    delta, prefix, read = detokenize_incrementally(tokenizer, ids, prefix, read, final=True)
    return seen, text + delta


@pytest.mark.parametrize("name,tokenizer", list(tokenizers()), ids=lambda v: v if isinstance(v, str) else "")
def test_incremental_text_equals_full_decode(name, tokenizer):
    rng = random.Random(0)
    special = [tokenizer.eos_token_id]
    cases = [tokenizer(t, add_special_tokens=False).input_ids for t in TEXTS]
    cases.append(cases[0][:3] + special + cases[1] + special)  # special tokens decode to nothing
    # arbitrary token salad; random byte-fallback tokens are left out, as invalid UTF-8 has no one right text
    pool = [i for tok, i in tokenizer.get_vocab().items() if not tok.startswith("<0x")]
    cases += [[rng.choice(pool) for _ in range(30)] for _ in range(20)]
    for ids in cases:
        full = tokenizer.decode(ids, skip_special_tokens=True)
        seen, final = stream(tokenizer, ids)
        assert final == full, (name, ids)
        assert all(full.startswith(text) for text in seen), (name, ids)  # streamed text is never taken back


def test_window_stays_short():
    """Each step decodes the last emitted tokens and the new one, not the whole output."""
    tokenizer = sentencepiece_like()
    ids = tokenizer(TEXTS[0] * 3, add_special_tokens=False).input_ids
    prefix = read = 0
    for n in range(1, len(ids) + 1):
        _, prefix, read = detokenize_incrementally(tokenizer, ids[:n], prefix, read)
        assert n - prefix <= 2


def test_character_split_across_tokens_is_held_back():
    """Byte-fallback tokens of one multi-byte character: nothing is emitted until its last byte arrives."""
    tokenizer = sentencepiece_like()
    rocket = [tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "🚀".encode()]
    seen, final = stream(tokenizer, rocket)
    assert seen == ["", "", "", "🚀"] and final == "🚀"
    seen, final = stream(tokenizer, rocket[:2])  # cut off: the full decode's replacement character, once, at the end
    assert seen == ["", ""] and final == tokenizer.decode(rocket[:2])
