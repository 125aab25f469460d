"""Tiny random Llama-family checkpoints (with a small trained tokenizer) written to disk for fast tests."""

from __future__ import annotations

from pathlib import Path

import torch

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Prefill builds the cache; decode reads it.",
    "Large language models generate text one token at a time, reading their weights every step.",
    "Le modèle lit le cache et produit le jeton suivant. 模型逐个生成词元。 1234567890 + - * / = ( )",
] * 4


def build_tokenizer(out: Path, vocab_size: int = 320):
    """A byte-level BPE trained on a few sentences, with ChatML special tokens (any text encodes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|im_end|>")
    fast.chat_template = CHATML
    fast.save_pretrained(out)
    return fast


def build_tiny_model(out: Path, arch: str = "llama", tie: bool = True, seed: int = 0, **overrides) -> Path:
    """Save a random 2-layer model of family `arch` ("llama", "qwen2", "mistral", or the Mixture-of-Experts "mixtral"
    and "qwen2_moe", with 4 and 8 experts, top-2) with its tokenizer into `out`."""
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out)
    cfg = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
               tie_word_embeddings=tie, initializer_range=0.2, bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    cfg.update(overrides)
    config_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                             "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                             "mistral": ("MistralConfig", "MistralForCausalLM"),
                             "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
                             "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM")}[arch]
    if arch in ("mistral", "mixtral"):
        cfg.setdefault("sliding_window", None)
    moe = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
           "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=64)}
    cfg = {**moe.get(arch, {}), **cfg}
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**cfg))
    model.save_pretrained(out)
    return out


def spelled_word(tokenizer, token_ids: list[int], length: int) -> tuple[int, str]:
    """Where `length` tokens of `token_ids` first spell printable text that encodes back to exactly them, and that
    text (a word to use as a bad word: random weights mostly write stray bytes)."""
    for i in range(len(token_ids) - length + 1):
        word = tokenizer.decode(token_ids[i:i + length])
        if word.strip() == word and word.isprintable() and \
                tokenizer(word, add_special_tokens=False).input_ids == token_ids[i:i + length]:
            return i, word
    raise AssertionError(f"no {length}-token word in {token_ids}")
