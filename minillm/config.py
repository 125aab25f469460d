"""The model's shape, read from a Hugging Face config.json into one flat, typed record."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs to know about a Llama-family model."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    rope_scaling: dict | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        """Build from a transformers `PretrainedConfig` (v4 `rope_theta`/`rope_scaling` or v5 `rope_parameters`)."""
        rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
        theta = rope.pop("rope_theta", None) or getattr(hf, "rope_theta", 10000.0)
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        eos = hf.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=float(theta),
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=hf.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False)),
            rope_scaling=scaling,
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        """Read `config.json` (and generation_config.json's eos ids, which chat models rely on)."""
        from transformers import AutoConfig, GenerationConfig

        config = cls.from_hf(AutoConfig.from_pretrained(str(path)))
        try:
            gen_eos = GenerationConfig.from_pretrained(str(path)).eos_token_id
        except OSError:
            return config
        gen_ids = tuple(gen_eos) if isinstance(gen_eos, (list, tuple)) else (() if gen_eos is None else (gen_eos,))
        eos = tuple(dict.fromkeys(config.eos_token_ids + gen_ids))
        return ModelConfig(**{**config.__dict__, "eos_token_ids": eos})

    @property
    def num_params(self) -> int:
        """Parameter count implied by the shape (the tied head counted once)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if self.qkv_bias else 0)
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * per_layer + h + head
