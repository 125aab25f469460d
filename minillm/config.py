"""Chapter 2 — the model's shape, read from a Hugging Face config.json into one flat, typed record."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs to know about a Llama-family model.

    A Mixture-of-Experts model (Mixtral, Qwen2-MoE) has `num_experts` > 0: its MoE layers route each token to
    `num_experts_per_tok` experts of `moe_intermediate_size` channels (plus, in Qwen2-MoE, a gated shared expert);
    its other layers (`mlp_only_layers`, or off the `decoder_sparse_step`) keep the dense MLP of `intermediate_size`.
    """

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
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalize the top-k routing weights to sum to 1 (Mixtral always does)
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        """Build from a transformers `PretrainedConfig` (v4 `rope_theta`/`rope_scaling` or v5 `rope_parameters`)."""
        rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
        theta = rope.pop("rope_theta", None) or getattr(hf, "rope_theta", 10000.0)
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        eos = hf.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        experts = getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None) or 0  # Mixtral, Qwen2-MoE
        expert_size = (getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size) if experts else 0
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
            qkv_bias=hf.model_type == "qwen2" or any(getattr(hf, k, False) for k in ("qkv_bias", "attention_bias")),
            rope_scaling=scaling,
            eos_token_ids=eos_ids,
            num_experts=experts,
            num_experts_per_tok=getattr(hf, "num_experts_per_tok", 0) if experts else 0,
            moe_intermediate_size=expert_size,
            shared_expert_intermediate_size=getattr(hf, "shared_expert_intermediate_size", 0) or 0,
            norm_topk_prob=bool(getattr(hf, "norm_topk_prob", True)),
            decoder_sparse_step=getattr(hf, "decoder_sparse_step", 1) or 1,
            mlp_only_layers=tuple(getattr(hf, "mlp_only_layers", None) or ()),
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

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether layer `layer_id` has a Mixture-of-Experts block in place of the dense MLP."""
        return (self.num_experts > 0 and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.decoder_sparse_step == 0)

    @property
    def num_params(self) -> int:
        """Parameter count implied by the shape (the tied head counted once; every expert counted)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if self.qkv_bias else 0)
        shared = 3 * h * self.shared_expert_intermediate_size + h if self.shared_expert_intermediate_size else 0
        moe = self.num_experts * (h + 3 * h * self.moe_intermediate_size) + shared  # router, experts, shared expert
        mlps = sum(moe if self.is_moe_layer(i) else 3 * h * self.intermediate_size for i in range(self.num_layers))
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * (attn + 2 * h) + mlps + h + head
