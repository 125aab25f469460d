"""Chapter 7 — mixture of experts (Mixtral, Qwen2-MoE): a router sends each token to its top k of many SwiGLU
experts.

The router scores every expert for every token (a linear layer, then a softmax in float32), keeps the k best, and
rescales their weights to sum to 1 (Mixtral always, Qwen2-MoE when `norm_topk_prob`). The experts' weights are
stacked, `[experts, 2 * intermediate, hidden]` for gate|up and `[experts, hidden, intermediate]` for down; the
(token, expert) pairs are sorted by expert so that each expert with work runs one matmul on its rows (a grouped
GEMM), and each token's output is the routing-weighted sum of its experts' outputs. Qwen2-MoE adds a shared expert
that every token uses, scaled by sigmoid(shared_expert_gate(x)).

Training often gives each expert a capacity (capacity factor x tokens x k / experts rows) and drops the pairs past
it, the token skipping that expert; this engine drops none: every pair is computed, however uneven the load.

Over a tensor-parallel group of N ranks the experts are split one of two ways:
- tensor parallel: every rank holds every expert, 1/N of each one's intermediate channels (gate|up by rows, down by
  columns, as in the dense MLP); the partial sums, the shared expert's included, meet in one all-reduce.
- expert parallel (`enable_expert_parallel`): rank r holds experts [r E/N, (r+1) E/N) whole. The hidden states are
  the same on every rank, so rank r takes the r-th contiguous slice of the tokens and routes it; an all-to-all sends
  each (token, expert) row to its expert's rank (dispatch), a second brings the results back (combine), and after
  the weighted sum an all-gather gives every rank every token again. The shared expert is held whole by every rank
  and runs on that rank's slice of the tokens, so it needs no communication of its own.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import Linear, silu_and_mul
from .parallel.comm import Comm
from .parallel.tensor_parallel import check_divisible


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's `top_k` experts and their routing weights (float32), `[tokens, top_k]` each: a softmax over the
    experts in float32 (as transformers computes it), its k largest entries, optionally rescaled to sum to 1."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The permutation that sorts the (token, k) pairs of `ids` `[tokens, top_k]` by expert (stable, so by token
    within an expert), and the number of pairs each expert got."""
    flat = ids.flatten()
    return flat.argsort(stable=True), torch.bincount(flat, minlength=num_experts)


def combine(rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each token's routing-weighted sum of its experts' outputs, `[tokens, hidden]`: `rows` are the outputs of the
    (token, k) pairs in `order`'s (expert-sorted) order, `weights` their float32 weights `[tokens, top_k]`."""
    pairs = torch.empty_like(rows)
    pairs[order] = rows
    return (pairs * weights.reshape(-1, 1)).view(*weights.shape, rows.shape[-1]).sum(dim=1).to(dtype)


class ExpertWeight(nn.Module):
    """One linear weight `[out, in]` per expert this rank holds, stacked `[experts, parts * out, in]` (gate|up has two
    parts); under tensor parallelism each rank keeps its slice of dimension `split_dim` of every expert's weight.

    A checkpoint fills it per expert (shard id `(expert, part)`: Mixtral's w1/w3/w2, Qwen2-MoE's gate/up/down_proj)
    or all at once (shard id None: transformers' fused `experts.gate_up_proj`, `[experts, parts * out, in]`).
    Tensors of experts another rank holds are skipped."""

    def __init__(self, num_experts: int, experts: range, num_parts: int, out_size: int, in_size: int, split_dim: int,
                 rank: int = 0, world: int = 1):
        super().__init__()
        self.num_experts, self.experts, self.num_parts = num_experts, experts, num_parts
        self.part_shape, self.split_dim, self.rank = (out_size, in_size), split_dim, rank
        local = [out_size, in_size]
        local[split_dim] //= world
        self.local_size = local[split_dim]
        self.weight = nn.Parameter(torch.empty(len(experts), num_parts * local[0], local[1]))
        self.fused = False  # filled from one tensor of every expert rather than from one per expert

    @property
    def shard_ids(self) -> tuple:
        """The checkpoint tensors this weight is filled from (see the class docstring)."""
        return (None,) if self.fused else tuple((e, p) for e in self.experts for p in range(self.num_parts))

    @torch.no_grad()
    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: tuple[int, int] | None = None) -> None:
        """Fill this rank's share of `param` from checkpoint tensor `loaded`, one expert's part or every expert's."""
        if shard_id is None:
            want = (self.num_experts, self.num_parts * self.part_shape[0], self.part_shape[1])
            if tuple(loaded.shape) != want:
                raise ValueError(f"fused expert tensor of shape {tuple(loaded.shape)} does not fit {want}")
            self.fused = True
            for e in self.experts:
                for p, part in enumerate(loaded[e].chunk(self.num_parts)):
                    self._load_part(param, e, p, part)
        elif shard_id[0] in self.experts:
            self._load_part(param, *shard_id, loaded)

    def _load_part(self, param: torch.Tensor, expert: int, part: int, loaded: torch.Tensor) -> None:
        """This rank's slice of part `part` of expert `expert`'s full weight `loaded` `[out, in]`."""
        if tuple(loaded.shape) != self.part_shape:
            raise ValueError(f"expert weight of shape {tuple(loaded.shape)} does not fit {self.part_shape}")
        j, rows, n = expert - self.experts.start, param.shape[1] // self.num_parts, self.local_size
        param[j, part * rows:(part + 1) * rows] = loaded.narrow(self.split_dim, self.rank * n, n)


class FusedMoE(nn.Module):
    """The experts of one MoE layer (vLLM's name), SwiGLU MLPs with stacked weights: `gate_up_proj.weight`
    `[experts, 2 I, hidden]` and `down_proj.weight` `[experts, hidden, I]`, of the experts and channels this rank
    holds (`local_experts`; I = the intermediate size, divided by the ranks under tensor parallelism)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: Comm | None = None,
                 expert_parallel: bool = False):
        super().__init__()
        rank, world = (0, 1) if tp is None else (tp.rank, tp.world_size)
        self.num_experts = num_experts
        if expert_parallel:  # whole experts, a contiguous share of them per rank
            if num_experts % world:
                raise ValueError(f"{num_experts} experts cannot be spread evenly over {world} ranks")
            per_rank = num_experts // world
            self.local_experts, channels = range(rank * per_rank, (rank + 1) * per_rank), (0, 1)
        else:  # every expert, a slice of each one's channels
            check_divisible("expert intermediate size", [intermediate_size], world)
            self.local_experts, channels = range(num_experts), (rank, world)
        experts, size = self.local_experts, intermediate_size
        self.gate_up_proj = ExpertWeight(num_experts, experts, 2, size, hidden_size, 0, *channels)
        self.down_proj = ExpertWeight(num_experts, experts, 1, hidden_size, size, 1, *channels)

    def grouped_mlp(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Each local expert's SwiGLU on its rows: `rows` sorted by local expert, `counts[j]` of them for the j-th."""
        out = rows.new_empty(rows.shape[0], self.down_proj.weight.shape[1])
        start = 0
        for j, n in enumerate(counts):
            if n:
                h = silu_and_mul(F.linear(rows[start:start + n], self.gate_up_proj.weight[j]))
                out[start:start + n] = F.linear(h, self.down_proj.weight[j])
            start += n
        return out

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every token of `x` through its experts `ids` (all held here), summed with its routing `weights`."""
        order, counts = sort_by_expert(ids, self.num_experts)
        rows = self.grouped_mlp(x[order // ids.shape[1]], counts.tolist())
        return combine(rows, order, weights, x.dtype)


class SparseMoeBlock(nn.Module):
    """The MoE layer in place of the dense MLP: the router (`gate`), the routed `experts`, and Qwen2-MoE's gated
    `shared_expert`, built by `mlp` (the model's SwiGLU MLP class) from a config and a group."""

    def __init__(self, config: ModelConfig, tp: Comm | None = None, expert_parallel: bool = False, mlp=None):
        super().__init__()
        self.tp, self.expert_parallel = tp, expert_parallel and tp is not None
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.gate = Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = FusedMoE(config.num_experts, config.hidden_size, config.moe_intermediate_size, tp,
                                self.expert_parallel)
        shared = config.shared_expert_intermediate_size
        shared_tp = None if self.expert_parallel else tp  # whole on every rank under expert parallelism
        self.shared_expert = mlp(replace(config, intermediate_size=shared), shared_tp) if shared else None
        self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False) if shared else None
        self.expert_counts: torch.Tensor | None = None  # tokens per expert while recording (`record_expert_load`)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The block's output for hidden states `x` `[tokens, hidden]`, plus `residual` when given."""
        out = self._expert_parallel(x) if self.expert_parallel else self._all_experts_here(x)
        return out if residual is None else residual + out

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts(self.gate.forward(x), self.top_k, self.renormalize)

    def _count(self, counts: torch.Tensor) -> None:
        if self.expert_counts is not None:
            self.expert_counts += counts

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's output times its gate; under tensor parallelism this rank's partial sum of it (its down
        projection's own all-reduce is skipped: the block's one all-reduce sums it with the experts')."""
        h = silu_and_mul(self.shared_expert.gate_up_proj.forward(x))
        return torch.sigmoid(self.shared_expert_gate.forward(x)) * self.shared_expert.down_proj.product(h, None, None)

    def _all_experts_here(self, x: torch.Tensor) -> torch.Tensor:
        """One process, or tensor parallel: every token through every expert's channels held here."""
        weights, ids = self._route(x)
        if self.expert_counts is not None:
            self._count(torch.bincount(ids.flatten(), minlength=self.num_experts))
        out = self.experts.forward(x, weights, ids)
        if self.shared_expert is not None:
            out = out + self._shared(x)
        return out if self.tp is None else self.tp.all_reduce(out)

    def _expert_parallel(self, x: torch.Tensor) -> torch.Tensor:
        """Expert parallel: route this rank's slice of the tokens, dispatch, run the local experts, combine, gather."""
        tp, k, n = self.tp, self.top_k, x.shape[0]
        world, rank, local = tp.world_size, tp.rank, self.experts.local_experts
        per_rank = -(-n // world)
        mine = x[min(rank * per_rank, n):min((rank + 1) * per_rank, n)]
        weights, ids = self._route(mine)
        order, counts = sort_by_expert(ids, self.num_experts)
        table = torch.stack(tp.all_gather(counts))  # [source rank, expert]: rows each rank routes to each expert
        between = table.view(world, world, -1).sum(dim=2)  # [source rank, destination rank]
        send, recv = between[rank].tolist(), between[:, rank].tolist()
        received = tp.all_to_all(mine[order // k], send, recv)  # by source rank, each source's rows by expert
        from_each = table[:, local.start:local.stop]  # [source rank, local expert]
        expert_of_row = torch.arange(len(local), device=x.device).repeat(world).repeat_interleave(from_each.flatten())
        regroup = expert_of_row.argsort(stable=True)  # the received rows grouped by local expert
        done = torch.empty_like(received)
        done[regroup] = self.experts.grouped_mlp(received[regroup], from_each.sum(dim=0).tolist())
        out = combine(tp.all_to_all(done, recv, send), order, weights, x.dtype)
        if self.shared_expert is not None:
            out = out + self._shared(mine)
        self._count(table.sum(dim=0))
        return torch.cat(tp.all_gather(F.pad(out, (0, 0, 0, per_rank - out.shape[0]))))[:n]


# Per-expert checkpoint names -> (our stacked weight, part of it): Mixtral's w1/w3/w2, Qwen2-MoE's and others'.
_EXPERT_PARTS = {"w1": ("gate_up_proj", 0), "gate_proj": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1),
                 "up_proj": ("gate_up_proj", 1), "w2": ("down_proj", 0), "down_proj": ("down_proj", 0)}


def moe_checkpoint_target(parts: list[str]) -> tuple[str, object] | None:
    """Our parameter and shard id for a layer's checkpoint name split on dots, if it is a router or expert weight
    (`layers.3.block_sparse_moe.experts.5.w1.weight` -> `layers.3.mlp.experts.gate_up_proj.weight`, (5, 0));
    None for any other name (the shared expert's projections map as a dense MLP's do)."""
    if len(parts) < 5 or parts[2] not in ("mlp", "block_sparse_moe"):
        return None
    block = ".".join([*parts[:2], "mlp"])
    if parts[3:] == ["gate", "weight"]:  # the router (Mixtral calls the block `block_sparse_moe`)
        return f"{block}.gate.weight", None
    if parts[3] != "experts":
        return None
    if len(parts) == 5:  # transformers' fused `experts.gate_up_proj` / `experts.down_proj`: every expert at once
        return f"{block}.experts.{parts[4]}.weight", None
    if len(parts) != 7 or parts[5] not in _EXPERT_PARTS:
        return None
    target, part = _EXPERT_PARTS[parts[5]]
    return f"{block}.experts.{target}.{parts[6]}", (int(parts[4]), part)


def moe_blocks(model: nn.Module) -> dict[int, SparseMoeBlock]:
    """The MoE blocks of a `CausalLM` (this rank's layers), by layer index."""
    return {i: layer.mlp for i, layer in zip(model.layer_ids, model.layers) if isinstance(layer.mlp, SparseMoeBlock)}


def record_expert_load(model: nn.Module, enable: bool = True) -> None:
    """Start counting, from zero, the tokens each MoE layer of `model` routes to each expert (or stop counting)."""
    for block in moe_blocks(model).values():
        block.expert_counts = (torch.zeros(block.num_experts, dtype=torch.long, device=block.gate.weight.device)
                               if enable else None)


def expert_load(model: nn.Module) -> dict[int, torch.Tensor]:
    """Tokens routed to each expert since `record_expert_load`, `{layer index: counts [experts]}`; each layer's
    counts sum to the tokens the model ran times top_k.

    On rank 0's model of a parallel layout the counts cover every token (expert-parallel ranks exchange theirs
    anyway), and `counts.view(ranks, -1).sum(1)` is the rows each rank's experts computed; other pipeline stages'
    layers are not on rank 0."""
    return {i: block.expert_counts.cpu() for i, block in moe_blocks(model).items() if block.expert_counts is not None}
