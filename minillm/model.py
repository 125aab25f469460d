"""Chapter 2 — a Llama-family decoder in plain PyTorch: embeddings, N blocks (attention + SwiGLU MLP), norm, head.

`forward` runs one step over packed new tokens: prompts or chunks of them (prefill) and one token per
decoding sequence (decode), mixed in one call as continuous batching needs, with logits at each sequence's
last new token. Every layer writes its keys and values into the paged cache; attention takes the prefill
and decode tokens down separate paths (`attention.py`).

Inside a step, modules call their children's `forward` directly rather than through `nn.Module.__call__`:
that wrapper only dispatches hooks, which nothing here uses, and at batch 1 on a CPU its roughly 270
calls per decode step cost a measurable share of the time left over after the weight reads.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, cpu_decode_layer, paged_attention
from .config import ModelConfig
from .host_memory import huge_page_empty, use_huge_pages
from .layers import (Linear, RMSNorm, RotaryEmbedding, pack_weight, packed_linear, packed_min_rows, rotate,
                     runs_in_c, runs_packed, silu_and_mul, use_packed_weights)
from .moe import SparseMoeBlock, moe_checkpoint_target
from .parallel.comm import Comm
from .parallel.state import ParallelContext
from .parallel.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, gather_logits,
                                       pad_vocab)

if TYPE_CHECKING:
    from .kernels.decode_layers import DecodeLayers
    from .kernels.decode_step import FusedDecodeStep, StepEnds


class Attention(nn.Module):
    """Grouped-query self-attention: fused q/k/v projection, RoPE, cache write, attention, output projection."""

    def __init__(self, config: ModelConfig, tp: Comm | None = None):
        super().__init__()
        ranks = 1 if tp is None else tp.world_size  # each rank holds whole heads: its share of q and of k/v
        self.num_heads, self.num_kv_heads = config.num_heads // ranks, config.num_kv_heads // ranks
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, [q, kv, kv], tp, config.qkv_bias, config.head_dim)
        self.o_proj = RowParallelLinear(q, config.hidden_size, tp)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """`rope` holds the cos and signed sin of this step's positions, `[tokens, 1, head_dim]` each; `residual`,
        when given, is added to the output (inside the output projection)."""
        qkv = self.qkv_proj.forward(x)
        k_cache, v_cache, *scales = kv_cache  # scales only for a quantized pool
        if meta.prefill is None and meta.use_cpu_kernel and runs_in_c(qkv) and qkv.is_contiguous():  # decode, CPU: in C
            o = cpu_decode_layer(qkv, rope, k_cache, v_cache, meta, self.num_heads, self.scale, *scales)
            return self.o_proj.forward(o.flatten(1), residual)
        heads = qkv.view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk = rotate(heads[:, :self.num_heads + self.num_kv_heads], *rope)  # q and k heads rotated together
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = heads[:, self.num_heads + self.num_kv_heads:]
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, *scales)
        return self.o_proj.forward(o.flatten(1), residual)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, config: ModelConfig, tp: Comm | None = None):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, tp)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.down_proj.forward(silu_and_mul(self.gate_up_proj.forward(x)), residual)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x)). Each skip connection is added by the
    output projection before it (in the same oneDNN call on a CPU), not as an operation of its own."""

    def __init__(self, config: ModelConfig, tp: Comm | None = None, layer_id: int = 0, expert_parallel: bool = False):
        """A Mixture-of-Experts model's MoE layers (`config.is_moe_layer`) hold a `SparseMoeBlock` as their `mlp`,
        its experts split over `tp` by channels, or whole experts per rank when `expert_parallel`."""
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = (SparseMoeBlock(config, tp, expert_parallel, MLP) if config.is_moe_layer(layer_id)
                    else MLP(config, tp))

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        x = self.self_attn.forward(rope, self.input_layernorm.forward(x), kv_cache, meta, residual=x)
        return self.mlp.forward(self.post_attention_layernorm.forward(x), residual=x)


class CausalLM(nn.Module):
    """The whole model. Tokens are packed: `input_ids` and `positions` are 1-D over all new tokens.

    Under a parallel layout (`ctx`) a rank holds its pipeline stage's layers (`layer_ids`), sharded over its
    tensor-parallel group; the embedding lives on the first stage, the final norm and head on the last (a tied
    head keeps the embedding there too). Without one it is the whole model.
    """

    def __init__(self, config: ModelConfig, ctx: ParallelContext | None = None):
        super().__init__()
        self.config, self.ctx = config, ctx
        tp = None if ctx is None else ctx.tp
        first, last = (True, True) if ctx is None else (ctx.is_first_stage, ctx.is_last_stage)
        self.layer_ids = range(config.num_layers) if ctx is None else ctx.layers(config.num_layers)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.max_position_embeddings,
                                      config.rope_scaling)
        tied = config.tie_word_embeddings
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
                             if first or (last and tied) else None)
        self.layers = nn.ModuleList(DecoderLayer(config, tp, i, ctx is not None and ctx.config.enable_expert_parallel)
                                    for i in self.layer_ids)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if last else None
        self.lm_head = (ColumnParallelLinear(config.hidden_size, [pad_vocab(config.vocab_size, tp)], tp)
                        if last and not tied else None)
        self.packed_head: torch.Tensor | None = None  # the tied head's oneDNN-packed copy (see pack_weights)
        self.packed_min_rows = 1  # products of fewer rows run through F.linear (see pack_weights)
        # decode-only steps as one call where the layers allow it (`fused_decode`); MINILLM_FUSED_STEP=0: never
        self.use_fused_step = os.environ.get("MINILLM_FUSED_STEP", "1") != "0"
        self._fused: tuple | None = None  # (cache, (first qkv, embedding, head), step or None) of the last build

    def pack_weights(self) -> None:
        """Give every linear layer, and a tied head, a oneDNN-packed copy of its weight (CPU, after loading), used
        from the row count at which it beats `F.linear` on this CPU, timed on the largest layer's shape.

        The copies double the weights' memory; the plain tensors stay for everything that reads the model.
        """
        linears = [module for module in self.modules() if isinstance(module, Linear)]
        largest = max(linears, key=lambda m: m.weight.numel())
        self.packed_min_rows = packed_min_rows(largest.out_features, largest.in_features, torch.get_num_threads())
        for module in linears:
            module.pack(self.packed_min_rows)
        if self.lm_head is None and self.norm is not None:
            self.packed_head = pack_weight(self.embed_tokens.weight)

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """This rank's decoder layers over hidden states `x` `[tokens, hidden]` (its cache's layers in order): a
        decode-only step in one call where `fused_decode` has one, else layer by layer."""
        step = self._decode_step(kv_cache, meta)
        if step is not None:
            return step(x.contiguous(), positions, meta.slot_mapping, meta.block_tables, meta.context_lens)
        rope = self.rotary.cos_sin(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer.forward(rope, x, kv_cache.layer(i), meta)
        return x

    def _decode_step(self, kv_cache, meta: AttentionMetadata) -> FusedDecodeStep | DecodeLayers | None:
        """The step `fused_decode` has for this decode-only step on a CPU, or None (another step, or none)."""
        if meta.prefill is None and meta.use_cpu_kernel and self.use_fused_step:
            return self.fused_decode(kv_cache)
        return None

    def fused_decode(self, kv_cache) -> FusedDecodeStep | DecodeLayers | None:
        """This model's decode step as one call over `kv_cache`, or None where none applies. A quantized model whose
        four products per layer are in the C kernel's int4/int8 layouts (quantized on a CPU with that kernel) gets
        the fused C step (`kernels/decode_step.py`), from token ids to logits where its embedding and head are int8
        (`quant.quantize_model`'s); a float32 one on a CPU gets its layers' own operations in one
        C++ loop (`kernels/decode_layers.py`). Both need no bias but on q/k/v, a dense MLP, the whole model in this
        process, a float32 or int8 cache, and their code built. Built at the first call for a cache, and again
        when the layers, the embedding or the head were replaced since."""
        modules = (self.layers[0].self_attn.qkv_proj, self.embed_tokens, self.lm_head)
        if self._fused is None or self._fused[0] is not kv_cache or any(
                a is not b for a, b in zip(self._fused[1], modules)):
            self._fused = (kv_cache, modules, _fused_decode_step(self, kv_cache))
        return self._fused[2]

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache,
                      meta: AttentionMetadata) -> torch.Tensor:
        """Final-norm hidden state of every new token, `[tokens, hidden]`."""
        x = self.run_layers(self.embed_tokens(input_ids), positions, kv_cache, meta)
        return self.norm.forward(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Vocabulary scores from hidden states (the tied head reuses the embedding matrix). Under tensor
        parallelism each rank scores its slice of the vocabulary and rank 0 gets them all (None elsewhere)."""
        if self.lm_head is not None:
            local = self.lm_head.forward(hidden)
        elif hidden.shape[0] >= self.packed_min_rows and runs_packed(self.packed_head):
            local = packed_linear(hidden, self.packed_head)
        else:
            local = F.linear(hidden, self.embed_tokens.weight)
        return gather_logits(None if self.ctx is None else self.ctx.tp, local, self.config.vocab_size)

    def final_logits(self, x: torch.Tensor, meta: AttentionMetadata,
                     logits_indices: torch.Tensor | None = None) -> torch.Tensor | None:
        """The last stage's end: logits at `logits_indices` of the last layer's output `x` (by default at each
        sequence's last new token, `[seqs, vocab]`)."""
        if logits_indices is None and meta.num_prefills:
            logits_indices = torch.tensor(meta.query_lens, device=x.device).cumsum(0) - 1
        if logits_indices is not None:  # else one new token per sequence: every row is a last token
            x = x[logits_indices]
        return self.logits(self.norm.forward(x))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache, meta: AttentionMetadata,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """One step over packed tokens (prefill chunks and decode tokens mixed); logits at `logits_indices`.

        By default the logits are taken at each sequence's last new token, `[seqs, vocab]`.
        """
        step = self._decode_step(kv_cache, meta) if logits_indices is None else None
        if getattr(step, "ends", None) is not None:  # the whole step in one call
            return step.logits(input_ids, positions, meta.slot_mapping, meta.block_tables, meta.context_lens)
        x = self.run_layers(self.embed_tokens(input_ids), positions, kv_cache, meta)
        return self.final_logits(x, meta, logits_indices)


def _fused_decode_step(model: CausalLM, kv_cache) -> FusedDecodeStep | DecodeLayers | None:
    """`CausalLM.fused_decode`'s step, built from the model's layers, or None when they do not allow one."""
    from .kernels.decode_layers import DecodeLayers, decode_layers_available
    from .kernels.decode_step import FusedDecodeStep, LayerWeights, decode_step_available

    if (model.ctx is not None or kv_cache.k.dtype not in (torch.float32, torch.int8)
            or model.rotary.cos.dtype != torch.float32 or not all(isinstance(layer.mlp, MLP) for layer in model.layers)):
        return None
    products = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
                for layer in model.layers]
    if any(p.bias is not None for four in products for p in four[1:]):
        return None  # (a bias only on q/k/v, as Qwen2's)
    caches = [kv_cache.layer(i) for i in range(len(model.layers))]
    if all(isinstance(p, Linear) and p.weight.dtype == torch.float32 and p.weight.is_cpu for four in products
           for p in four) and decode_layers_available():
        return DecodeLayers(model.layers, caches, model.rotary.cos, model.rotary.sin_signed, model.config.rms_norm_eps)
    if not all(getattr(p, "kernel", None) is not None for four in products for p in four) \
            or not decode_step_available():
        return None
    layers = [LayerWeights(*(p.kernel for p in four), layer.input_layernorm.weight.detach(),
                           layer.post_attention_layernorm.weight.detach(),
                           None if four[0].bias is None else four[0].bias.detach().float().contiguous())
              for four, layer in zip(products, model.layers)]
    attn = model.layers[0].self_attn
    return FusedDecodeStep(layers, caches, model.rotary.cos, model.rotary.sin_signed, model.config.rms_norm_eps,
                           attn.num_heads, attn.num_kv_heads, _step_ends(model))


def _step_ends(model: CausalLM) -> StepEnds | None:
    """The model's embedding, final norm and head as the fused step takes them, or None where they are another
    kind (a float embedding, a head without the C kernel's layout or with a bias): the step then runs the layers
    only."""
    from .kernels.decode_step import StepEnds
    from .quant import QuantEmbedding

    embed, head = model.embed_tokens, model.lm_head
    if not (isinstance(embed, QuantEmbedding) and embed.format.name == "int8" and embed.scale.dim() == 1
            and embed.scale.dtype == torch.float32 and getattr(head, "kernel", None) is not None
            and head.bias is None and head.out_features == model.config.vocab_size):
        return None
    return StepEnds(embed.q, embed.scale, model.norm.weight.detach(), head.kernel)


def load_model(path, config: ModelConfig, dtype: torch.dtype, device: torch.device,
               load_format: str = "auto", seed: int = 0, ctx: ParallelContext | None = None,
               pack: bool = True, quantization: tuple[str, int | None] | None = None) -> CausalLM:
    """Build the model (or, under a parallel layout, this rank's part of it) on `device` and fill it from the
    checkpoint at `path` ("auto") or randomly ("dummy"). `pack=False` skips oneDNN's packed copies, for a model
    about to be quantized (they would double the float weights' memory only to be dropped). `quantization`
    (method, group size): each decoder layer's linear layers are quantized as soon as the checkpoint has filled
    that layer, and their float weights freed, so loading peaks near the quantized model's size rather than the
    float model's; `quant.quantize_model` does the rest (embedding, head) afterwards."""
    with torch.device("meta"):  # no time spent on random init of weights about to be overwritten
        model = CausalLM(config, ctx).to(dtype)
    model = model.to_empty(device=device)
    if device.type == "cpu" and use_huge_pages():
        _move_to_huge_pages(model)
    model.rotary.build_tables()  # buffers, not weights: computed rather than loaded
    if load_format == "dummy":
        _init_dummy(model, seed)
    elif load_format == "auto":
        from .weights import checkpoint_tensors

        layer_loaded = None
        if quantization is not None:
            from .quant import quantize_linears

            def layer_loaded(layer: nn.Module) -> None:
                quantize_linears(layer, *quantization)

        _load_hf_weights(model, checkpoint_tensors(path), layer_loaded)
    else:
        raise ValueError(f"load_format {load_format!r} is not supported; use 'auto' or 'dummy'")
    if pack and use_packed_weights(device, dtype):
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


# Hugging Face projection names -> (our fused projection, index of their part within it)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def checkpoint_target(model: CausalLM, name: str) -> tuple[str, object] | None:
    """Where checkpoint tensor `name` (Hugging Face's, without "model.") goes in `model`: (our parameter's name,
    which part of it), or None when this rank does not hold it (another pipeline stage's layer)."""
    parts = name.split(".")
    if parts[0] == "layers":
        index = int(parts[1])
        if index not in model.layer_ids:
            return None
        parts[1] = str(index - model.layer_ids.start)
        if (target := moe_checkpoint_target(parts)) is not None:  # a router or expert weight
            return target
    elif getattr(model, parts[0], None) is None:
        return None  # the embedding, norm or head of another stage
    if len(parts) >= 2 and parts[-2] in _FUSED:
        target, part = _FUSED[parts[-2]]
        return ".".join(parts[:-2] + [target, parts[-1]]), part
    return ".".join(parts), None


def _load_hf_weights(model: CausalLM, tensors, layer_loaded: Callable[[nn.Module], None] | None = None) -> None:
    """Fill our parameters from a Hugging Face checkpoint's `(name, read)` pairs, each through its layer's
    `weight_loader` (which keeps this rank's shard of it), reading only the tensors this rank holds; failing on
    anything missing or extra. `layer_loaded` is called with each decoder layer once all of its weights are in."""
    params = dict(model.named_parameters())

    def parts() -> list[tuple[str, object]]:  # every (parameter, part) to load, as the modules say now
        return [(name, part) for name in params
                for part in getattr(model.get_submodule(name.rpartition(".")[0]), "shard_ids", (None,))]

    waiting: dict[int, set] = {}  # decoder layer (local index) -> its weights not loaded yet
    for name, part in parts() if layer_loaded is not None else ():
        if name.startswith("layers."):
            waiting.setdefault(int(name.split(".")[1]), set()).add((name, part))
    loaded = set()
    with torch.no_grad():
        for hf_name, read in tensors:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue  # tied head saved anyway by some checkpoints
            target = checkpoint_target(model, name)
            if target is None:
                continue
            param_name, part = target
            if (param_name, part) in loaded and param_name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} appears twice")
            if param_name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the Llama-family model")
            loader = getattr(model.get_submodule(param_name.rpartition(".")[0]), "weight_loader", None)
            if loader is not None:
                loader(params[param_name], read(), part)
            else:
                params[param_name].copy_(read())
            loaded.add((param_name, part))
            if layer_loaded is not None and param_name.startswith("layers."):
                index = int(param_name.split(".")[1])
                waiting[index].discard((param_name, part))
                if not waiting[index]:
                    layer_loaded(model.layers[index])
                    for name in [n for n in params if n.startswith(f"layers.{index}.")]:
                        del params[name]  # a replaced float weight is freed only when nothing holds it
    missing = [name for name, part in parts() if (name, part) not in loaded]  # a layer done left `params` whole
    if missing:
        raise ValueError(f"checkpoint is missing weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
