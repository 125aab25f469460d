"""Chapter 7 — how a model is laid out over processes (vLLM's `ParallelConfig`): tensor parallel inside a
pipeline stage, pipeline stages one after another, optionally experts spread over the tensor-parallel ranks.

Rank `r` is tensor-parallel rank `r % tp` of pipeline stage `r // tp`; rank 0 also runs the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import ModelConfig


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def tp_rank(self, rank: int) -> int:
        return rank % self.tensor_parallel_size

    def pp_rank(self, rank: int) -> int:
        return rank // self.tensor_parallel_size

    def layer_range(self, num_layers: int, pp_rank: int) -> range:
        """The layers pipeline stage `pp_rank` holds: contiguous, the first stages taking one more when the
        layers do not divide evenly."""
        base, extra = divmod(num_layers, self.pipeline_parallel_size)
        start = pp_rank * base + min(pp_rank, extra)
        return range(start, start + base + (pp_rank < extra))

    def check(self, config: ModelConfig) -> None:
        """Raise a ValueError naming the problem if `config` cannot be laid out this way."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        for name, value in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if config.num_heads % tp or config.num_kv_heads % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide the model's {config.num_heads} query heads and "
                             f"{config.num_kv_heads} key/value heads (each rank holds whole heads); "
                             f"try one of {[n for n in range(1, config.num_kv_heads + 1) if _fits(config, n)]}")
        dense = [i for i in range(config.num_layers) if not config.is_moe_layer(i)]
        if dense and config.intermediate_size % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide the MLP's {config.intermediate_size} channels")
        split_experts = config.num_experts and not self.enable_expert_parallel  # each expert split by channels
        for what, channels in (("an expert's", config.moe_intermediate_size),
                               ("the shared expert's", config.shared_expert_intermediate_size)):
            if split_experts and channels % tp:
                raise ValueError(f"tensor_parallel_size={tp} must divide {what} {channels} channels "
                                 "(or set enable_expert_parallel=True to spread whole experts over the ranks)")
        if pp > config.num_layers:
            raise ValueError(f"pipeline_parallel_size={pp} exceeds the model's {config.num_layers} layers")
        experts = config.num_experts
        if self.enable_expert_parallel and not experts:
            raise ValueError("enable_expert_parallel needs a Mixture-of-Experts model; this one has no experts")
        if self.enable_expert_parallel and experts % tp:
            raise ValueError(f"{experts} experts cannot be spread evenly over tensor_parallel_size={tp} ranks")

    def local_config(self, config: ModelConfig, rank: int) -> ModelConfig:
        """The shape rank `rank` holds: its stage's layers and its share of the heads (what its KV cache stores)."""
        tp = self.tensor_parallel_size
        return replace(config, num_layers=len(self.layer_range(config.num_layers, self.pp_rank(rank))),
                       num_heads=config.num_heads // tp, num_kv_heads=config.num_kv_heads // tp)


def _fits(config: ModelConfig, tp: int) -> bool:
    return config.num_heads % tp == 0 and config.num_kv_heads % tp == 0 and config.intermediate_size % tp == 0
