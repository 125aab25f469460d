"""A Llama-family decoder in plain PyTorch: embeddings, N blocks (attention + SwiGLU MLP), norm, head.

`prefill` runs many new tokens (whole prompts, packed) and returns logits at each sequence's last
token; `decode` runs one new token per sequence; a continuously batched step mixes both in one call.
All write their keys and values into the paged cache.

Inside a step, modules call their children's `forward` directly rather than through `nn.Module.__call__`:
that wrapper only dispatches hooks, which nothing here uses, and at batch 1 on a CPU its roughly 270
calls per decode step cost a measurable share of the time left over after the weight reads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, paged_attention
from .config import ModelConfig
from .host_memory import huge_page_empty, use_huge_pages
from .layers import (Linear, RMSNorm, RotaryEmbedding, make_linear, pack_weight, packed_linear, rotate, runs_packed,
                     silu_and_mul, use_packed_weights)


class Attention(nn.Module):
    """Grouped-query self-attention: fused q/k/v projection, RoPE, cache write, attention, output projection."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = make_linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = make_linear(self.q_size, config.hidden_size)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """`rope` holds the cos and signed sin of this step's positions, `[tokens, 1, head_dim]` each; `residual`,
        when given, is added to the output (inside the output projection)."""
        heads = self.qkv_proj.forward(x).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk = rotate(heads[:, :self.num_heads + self.num_kv_heads], *rope)  # q and k heads rotated together
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = heads[:, self.num_heads + self.num_kv_heads:]
        k_cache, v_cache, *scales = kv_cache  # scales only for a quantized pool
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, *scales)
        return self.o_proj.forward(o.flatten(1), residual)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = make_linear(config.hidden_size, 2 * config.intermediate_size)
        self.down_proj = make_linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.down_proj.forward(silu_and_mul(self.gate_up_proj.forward(x)), residual)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x)). Each skip connection is added by the
    output projection before it (in the same oneDNN call on a CPU), not as an operation of its own."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        x = self.self_attn.forward(rope, self.input_layernorm.forward(x), kv_cache, meta, residual=x)
        return self.mlp.forward(self.post_attention_layernorm.forward(x), residual=x)


class CausalLM(nn.Module):
    """The whole model. Tokens are packed: `input_ids` and `positions` are 1-D over all new tokens."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.max_position_embeddings,
                                      config.rope_scaling)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else make_linear(config.hidden_size, config.vocab_size)
        self.packed_head: torch.Tensor | None = None  # the tied head's oneDNN-packed copy (see pack_weights)

    def pack_weights(self) -> None:
        """Give every linear layer, and a tied head, a oneDNN-packed copy of its weight (CPU, after loading).

        The copies double the weights' memory; the plain tensors stay for everything that reads the model.
        """
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        if self.lm_head is None:
            self.packed_head = pack_weight(self.embed_tokens.weight)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache,
                      meta: AttentionMetadata) -> torch.Tensor:
        """Final-norm hidden state of every new token, `[tokens, hidden]`."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary.cos_sin(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer.forward(rope, x, kv_cache.layer(i), meta)
        return self.norm.forward(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary scores from hidden states (the tied head reuses the embedding matrix)."""
        if self.lm_head is not None:
            return self.lm_head.forward(hidden)
        if runs_packed(self.packed_head):
            return packed_linear(hidden, self.packed_head)
        return F.linear(hidden, self.embed_tokens.weight)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache, meta: AttentionMetadata,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """One step over packed tokens (prefill chunks and decode tokens mixed); logits at `logits_indices`.

        By default the logits are taken at each sequence's last new token, `[seqs, vocab]`.
        """
        hidden = self.hidden_states(input_ids, positions, kv_cache, meta)
        if logits_indices is None:
            if meta.num_prefills == 0:  # one new token per sequence: every row is a last token
                return self.logits(hidden)
            logits_indices = torch.tensor(meta.query_lens, device=hidden.device).cumsum(0) - 1
        return self.logits(hidden[logits_indices])

    def prefill(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache,
                meta: AttentionMetadata) -> torch.Tensor:
        """Process prompts (many tokens per sequence); logits at each sequence's last token, `[seqs, vocab]`."""
        return self(input_ids, positions, kv_cache, meta)

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache,
               meta: AttentionMetadata) -> torch.Tensor:
        """One step: one new token per sequence in, next-token logits `[seqs, vocab]` out."""
        assert all(n == 1 for n in meta.query_lens), "decode() takes one new token per sequence"
        return self(input_ids, positions, kv_cache, meta)


def load_model(path, config: ModelConfig, dtype: torch.dtype, device: torch.device,
               load_format: str = "auto", seed: int = 0) -> CausalLM:
    """Build the model on `device` and fill it from the checkpoint at `path` ("auto") or randomly ("dummy")."""
    with torch.device("meta"):  # no time spent on random init of weights about to be overwritten
        model = CausalLM(config).to(dtype)
    model = model.to_empty(device=device)
    if device.type == "cpu" and use_huge_pages():
        _move_to_huge_pages(model)
    model.rotary.build_tables()  # buffers, not weights: computed rather than loaded
    if load_format == "dummy":
        _init_dummy(model, seed)
    elif load_format == "auto":
        from .weights import load_state_dict

        _load_hf_weights(model, load_state_dict(path))
    else:
        raise ValueError(f"load_format {load_format!r} is not supported; use 'auto' or 'dummy'")
    if use_packed_weights(device, dtype):
        model.pack_weights()
    return model.eval()


def _move_to_huge_pages(model: nn.Module) -> None:
    """Give every (still unfilled) parameter a slice of one huge-page-backed block (see host_memory.py)."""
    params = list(model.parameters())
    block = huge_page_empty(sum(p.numel() for p in params), params[0].dtype)
    offset = 0
    for p in params:
        p.data = block[offset:offset + p.numel()].view(p.shape)
        offset += p.numel()


def _init_dummy(model: CausalLM, seed: int) -> None:
    """Random weights of the right shapes (norm gains 1), for timing without a checkpoint."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


# Hugging Face projection names -> (our fused projection, index of their slice within it)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def _load_hf_weights(model: CausalLM, state: dict[str, torch.Tensor]) -> None:
    """Copy a Hugging Face Llama state dict into our (fused) parameters, failing on anything missing or extra."""
    params = dict(model.named_parameters())
    attn = model.layers[0].self_attn
    sizes = {"qkv_proj": [attn.q_size, attn.kv_size, attn.kv_size],
             "gate_up_proj": [model.config.intermediate_size] * 2}
    loaded = set()
    with torch.no_grad():
        for hf_name, tensor in state.items():
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and model.lm_head is None:
                continue  # tied head saved anyway by some checkpoints
            parts = name.split(".")
            fused = _FUSED.get(parts[-2]) if len(parts) >= 2 else None
            if fused:
                target, idx = fused
                name = ".".join(parts[:-2] + [target, parts[-1]])
                offset = sum(sizes[target][:idx])
                params[name][offset:offset + sizes[target][idx]].copy_(tensor)
                loaded.add((name, idx))
            elif name in params:
                params[name].copy_(tensor)
                loaded.add((name, 0))
            else:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the Llama-family model")
    missing = [n for n in params if not all((n, i) in loaded for i in range(len(sizes.get(n.split(".")[-2], [0]))))]
    if missing:
        raise ValueError(f"checkpoint is missing weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
