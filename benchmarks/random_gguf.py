"""Random-weight models of real shapes, written once as a GGUF file that llama.cpp quantizes and minillm reads back,
so that both engines run identical numbers at sizes the default model does not reach.

`write_gguf` draws every matrix from N(0, 0.02²) (norm gains 1, as minillm's `load_format="dummy"` does) and writes
it as float16 in llama.cpp's layout, with the default model's tokenizer (padded with control tokens where a shape's
vocabulary is larger). After `llama-quantize`, `gguf_to_hf` turns the quantized file back into a Hugging Face
directory for minillm: each block decoded by `minillm.gguf_blocks` (so Q4_1 lands exactly on minillm's int4 grid
of group 32), and the query and key rows of a Llama-architecture file put back in Hugging Face's order.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, GGUFWriter, LlamaFileType, TokenType
from safetensors.torch import save_file

from minillm.config import ModelConfig
from minillm.gguf_blocks import decode_q4_1, decode_q8_0, tensor_parts
from minillm.weights import default_gguf_path, resolve_model

STD = 0.02  # of every random matrix, as in minillm's dummy weights


@dataclass(frozen=True)
class Shape:
    """One model's shape: its name, llama.cpp's name for its family ("llama", or "qwen2": query/key/value biases,
    rotary halves in Hugging Face's order) and the `ModelConfig` minillm reads from its config.json."""

    name: str
    arch: str
    config: ModelConfig

    @property
    def num_params(self) -> int:
        """Parameters, the tied embedding counted once."""
        return self.config.num_params

    def hf_config(self) -> dict:
        """A config.json for transformers and minillm: tied embeddings, plain rotary positions."""
        c = self.config
        return {"architectures": ["Qwen2ForCausalLM" if self.arch == "qwen2" else "LlamaForCausalLM"],
                "model_type": self.arch, "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
                "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
                "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
                "rope_theta": c.rope_theta, "rms_norm_eps": c.rms_norm_eps,
                "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": True,
                "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}


def make_shape(name: str, arch: str, vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int,
          head_dim: int, theta: float, eps: float) -> Shape:
    """A `Shape` from the numbers of a Hugging Face config, in its order."""
    return Shape(name, arch, ModelConfig(vocab, hidden, inter, layers, heads, kv_heads, head_dim, eps, theta, 8192,
                                         True, qkv_bias=arch == "qwen2", eos_token_ids=(2,)))


# Real models' shapes (their configs), with random weights; the rope scaling of Llama-3.2 is left out.
SHAPES = {s.name: s for s in (
    make_shape("smollm2-135m", "llama", 49152, 576, 1536, 30, 9, 3, 64, 100000.0, 1e-5),
    make_shape("smollm2-360m", "llama", 49152, 960, 2560, 32, 15, 5, 64, 100000.0, 1e-5),
    make_shape("llama-3.2-1b", "llama", 128256, 2048, 8192, 16, 32, 8, 64, 500000.0, 1e-5),
    make_shape("qwen2.5-1.5b", "qwen2", 151936, 1536, 8960, 28, 12, 2, 128, 1000000.0, 1e-6),
    make_shape("smollm2-1.7b", "llama", 49152, 2048, 8192, 24, 32, 32, 64, 130000.0, 1e-5),
)}


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's query/key rows in llama.cpp's order for a Llama-architecture file: within each head, the
    two rotary halves interleaved (what llama.cpp's converter does)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `permute_rows`: llama.cpp's query/key rows back in Hugging Face's order."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _tokenizer_fields(reader: GGUFReader, vocab_size: int) -> dict:
    """The default model's tokenizer from its GGUF, padded with control tokens to `vocab_size` entries."""
    get = {name: reader.fields[f"tokenizer.ggml.{name}"].contents()
           for name in ("model", "pre", "tokens", "token_type", "merges", "bos_token_id", "eos_token_id",
                        "unknown_token_id", "padding_token_id")}
    pad = vocab_size - len(get["tokens"])
    if pad < 0:
        raise ValueError(f"a vocabulary of {vocab_size} is smaller than the tokenizer's {len(get['tokens'])}")
    get["tokens"] = list(get["tokens"]) + [f"<|pad_{i}|>" for i in range(pad)]
    get["token_type"] = list(get["token_type"]) + [int(TokenType.CONTROL)] * pad
    return get


def write_gguf(shape: Shape, path: Path, seed: int = 0) -> None:
    """A float16 GGUF of `shape` with random weights (seeded), readable by llama.cpp and its `llama-quantize`."""
    rng, c = np.random.default_rng(seed), shape.config

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * STD).astype(np.float16)

    h, hd = c.hidden_size, c.head_dim
    w = GGUFWriter(str(path), shape.arch)
    w.add_name(f"random {shape.name}")
    w.add_context_length(8192)
    w.add_embedding_length(h)
    w.add_block_count(c.num_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(LlamaFileType.MOSTLY_F16)
    tok = _tokenizer_fields(GGUFReader(str(default_gguf_path())), c.vocab_size)
    w.add_tokenizer_model(tok["model"])
    w.add_tokenizer_pre(tok["pre"])
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["token_type"])
    w.add_token_merges(tok["merges"])
    w.add_bos_token_id(tok["bos_token_id"])
    w.add_eos_token_id(tok["eos_token_id"])
    w.add_unk_token_id(tok["unknown_token_id"])
    w.add_pad_token_id(tok["padding_token_id"])
    w.add_add_bos_token(False)

    ones = np.ones(h, dtype=np.float32)
    w.add_tensor("token_embd.weight", matrix(c.vocab_size, h))
    for i in range(c.num_layers):
        q, k = matrix(c.num_heads * hd, h), matrix(c.num_kv_heads * hd, h)
        if shape.arch == "llama":
            q, k = permute_rows(q, c.num_heads), permute_rows(k, c.num_kv_heads)
        blk = f"blk.{i}."
        w.add_tensor(blk + "attn_norm.weight", ones)
        w.add_tensor(blk + "attn_q.weight", q)
        w.add_tensor(blk + "attn_k.weight", k)
        w.add_tensor(blk + "attn_v.weight", matrix(c.num_kv_heads * hd, h))
        if shape.arch == "qwen2":
            heads, kv_heads = c.num_heads, c.num_kv_heads
            for name, rows in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                w.add_tensor(blk + f"attn_{name}.bias", matrix(1, rows * hd).reshape(-1).astype(np.float32))
        w.add_tensor(blk + "attn_output.weight", matrix(h, c.num_heads * hd))
        w.add_tensor(blk + "ffn_norm.weight", ones)
        w.add_tensor(blk + "ffn_gate.weight", matrix(c.intermediate_size, h))
        w.add_tensor(blk + "ffn_up.weight", matrix(c.intermediate_size, h))
        w.add_tensor(blk + "ffn_down.weight", matrix(h, c.intermediate_size))
    w.add_tensor("output_norm.weight", ones)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


HF_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
            "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
            "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def _decoded(tensor) -> torch.Tensor:
    """One GGUF tensor as float32 in its row-major shape (Q4_1 and Q8_0 through minillm's block decoders)."""
    raw, kind, shape = tensor_parts(tensor)
    if kind in ("F32", "F16"):
        return torch.from_numpy(np.array(tensor.data, dtype=np.float32)).reshape(shape)
    decode = {"Q4_1": decode_q4_1, "Q8_0": decode_q8_0}.get(kind)
    if decode is None:
        raise ValueError(f"tensor {tensor.name} is {kind}; only F32, F16, Q8_0 and Q4_1 are read here")
    return decode(raw).reshape(shape)


def hf_name(gguf_name: str) -> str:
    """A GGUF tensor's Hugging Face name: blk.3.attn_q.bias -> model.layers.3.self_attn.q_proj.bias."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    _, layer, part, kind = gguf_name.split(".")
    if part not in HF_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face name here")
    return f"model.layers.{layer}.{HF_NAMES[part]}.{kind}"


def gguf_to_hf(gguf: Path, shape: Shape, out: Path) -> None:
    """A Hugging Face directory (config, float32 safetensors one layer a file, the default model's tokenizer)
    holding exactly the weights `gguf` stores, decoded from its blocks."""
    out.mkdir(parents=True, exist_ok=True)
    c = shape.config
    reader = GGUFReader(str(gguf))
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        w = _decoded(tensor)
        if shape.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = unpermute_rows(w, c.num_heads if "q_proj" in name else c.num_kv_heads)
        shard = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        shards.setdefault(shard, {})[name] = w.contiguous()
    for shard, tensors in shards.items():
        save_file(tensors, str(out / f"model-{shard}.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(shape.hf_config(), indent=1) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(resolve_model() / name, out / name)
