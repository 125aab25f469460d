"""Chapter 6 — pruning: taking weights out of the model and measuring what that costs, on the engine's own model.

Three granularities, from the finest to the coarsest:

    unstructured   the lowest-scoring weights of each projection set to 0     any sparsity; as slow as dense
    2:4            in every 4 consecutive inputs of a row, the best 2 kept     50 %; a GPU's sparse tensor cores
                                                                              run it faster, a CPU does not
    structured     whole MLP channels or attention heads cut out              smaller dense matrices: faster anywhere

A weight's score is its magnitude |w|, or, given `input_rms` (the root-mean-square of each input feature over
a calibration text, `calibrate`), |w| times the size of the input it multiplies: what it adds to the output
(Wanda's score). Only the decoder layers' linear layers are pruned; the embedding (and the head tied to it)
and the norms stay. Each function changes `llm`'s model in place, repacks the oneDNN copies of the weights it
changed (on a CPU the engine computes with those, not with `weight`), forgets the engine's cached prefixes
(their keys and values came from the old weights), and returns a `PruneResult` saying how much went.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from .layers import Linear
from .model import MLP, Attention, CausalLM
from .sampling import SamplingParams


@dataclass
class PruneResult:
    """What a pruning call took out: weights zeroed (unstructured, n:m) or cut out (structured)."""

    method: str
    pruned: int          # weights set to zero or removed
    linear_params: int   # weights of the decoder layers' linear layers before pruning
    model_params: int    # every parameter of the model before pruning (the tied embedding counted once)
    removed: dict[int, list[int]] = field(default_factory=dict)  # structured: layer -> channels or heads removed

    @property
    def sparsity(self) -> float:
        """Share of the decoder layers' linear weights pruned."""
        return self.pruned / self.linear_params

    @property
    def model_fraction(self) -> float:
        """Share of all the model's parameters pruned."""
        return self.pruned / self.model_params


def calibrate(llm, text: str | list[int], window: int = 512) -> dict[str, torch.Tensor]:
    """Root-mean-square of every input feature of every decoder linear layer while the engine reads `text` (or
    token ids) in windows of `window` tokens (at most the engine's context), by the layer's qualified name
    (`"layers.0.mlp.down_proj"`)."""
    model = _model(llm)
    _, token_ids = llm.engine.tokenize(text)
    if len(token_ids) < 2 or window < 2:
        raise ValueError(f"calibration needs at least 2 tokens and a window of 2, got {len(token_ids)} and {window}")
    window = min(window, llm.engine.max_model_len - 1)
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def recorder(name: str, linear: Linear):
        def forward(x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
            sums[name] = sums.get(name, 0) + x.detach().float().square().sum(0)
            counts[name] = counts.get(name, 0) + x.shape[0]
            return type(linear).forward(linear, x, residual)
        return forward

    projections = _projections(model)
    llm.reset_prefix_cache()  # every token computed, none taken from the cache
    try:
        for name, linear, _ in projections:
            linear.forward = recorder(name, linear)  # the model calls `.forward` directly (no hooks)
        windows = [token_ids[i:i + window] for i in range(0, len(token_ids), window)]
        llm.generate(windows, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    finally:
        for _, linear, _ in projections:
            vars(linear).pop("forward", None)
    return {name: (sums[name] / counts[name]).sqrt() for name in sums}


def magnitude_mask(scores: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Boolean mask of the entries to keep: all but the `round(sparsity * numel)` with the smallest |score|.

    The cut is the `drop`-th smallest |score| (a selection, about 3x faster than a partial sort here); of the
    entries equal to it, the first ones in memory order go, so exactly `drop` are dropped even among ties."""
    _check_fraction("sparsity", sparsity)
    magnitude = scores.detach().abs().flatten()
    drop = round(sparsity * magnitude.numel())
    if not drop:
        return torch.ones_like(scores, dtype=torch.bool)
    cut = magnitude.kthvalue(drop).values
    keep = magnitude > cut
    at_cut = (magnitude == cut).nonzero().flatten()
    keep[at_cut[drop - (magnitude.numel() - int(keep.sum()) - at_cut.numel()):]] = True
    return keep.view(scores.shape)


def n_m_mask(scores: torch.Tensor, n: int = 2, m: int = 4) -> torch.Tensor:
    """Boolean mask keeping the `n` largest |score| in every `m` consecutive inputs of each row of `[out, in]`."""
    if not 0 < n < m:
        raise ValueError(f"n:m sparsity needs 0 < n < m, got {n}:{m}")
    if scores.dim() != 2 or scores.shape[1] % m:
        raise ValueError(f"n:m sparsity needs a 2-D weight whose inputs are a multiple of m={m}, "
                         f"got {tuple(scores.shape)}")
    groups = scores.detach().abs().view(scores.shape[0], -1, m)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(-1, groups.topk(n, dim=-1).indices, True)
    return keep.view(scores.shape)


def prune_magnitude(llm, sparsity: float, input_rms: dict[str, torch.Tensor] | None = None) -> PruneResult:
    """Zero the lowest-scoring `sparsity` share of the weights in each projection (q, k, v, o, gate, up, down).

    Each projection gets the same sparsity (the fused q|k|v and gate|up matrices are masked part by part), so
    no projection loses more than its share because its weights happen to be smaller than its neighbours'.
    """
    _check_fraction("sparsity", sparsity)
    method = f"unstructured {sparsity:.0%}" + (" (calibrated)" if input_rms else "")
    return _apply_masks(llm, method, input_rms, lambda scores: magnitude_mask(scores, sparsity))


def prune_n_m(llm, n: int = 2, m: int = 4, input_rms: dict[str, torch.Tensor] | None = None) -> PruneResult:
    """n:m semi-structured sparsity (2:4 by default) in every linear layer of every decoder layer.

    The pattern is what NVIDIA's sparse tensor cores accept (half the products skipped); on a CPU the zeros
    are stored and multiplied like any other weight, so this shows the accuracy, not the speed.
    """
    if not 0 < n < m:
        raise ValueError(f"n:m sparsity needs 0 < n < m, got {n}:{m}")
    method = f"{n}:{m}" + (" (calibrated)" if input_rms else "")
    return _apply_masks(llm, method, input_rms, lambda scores: n_m_mask(scores, n, m))


def mlp_channel_scores(mlp: MLP, down_input_rms: torch.Tensor | None = None) -> torch.Tensor:
    """Importance of each intermediate channel of a SwiGLU MLP, `[intermediate]`: the norm of its down_proj column
    (the weights that carry it out) times the channel's measured root-mean-square when given, else times the
    norms of its gate and up rows (the weights that feed it)."""
    down = mlp.down_proj.weight.detach().norm(dim=0)
    if down_input_rms is not None:
        return down * down_input_rms
    gate, up = mlp.gate_up_proj.weight.detach().chunk(2, dim=0)
    return down * gate.norm(dim=1) * up.norm(dim=1)


def prune_mlp_channels(llm, fraction: float, input_rms: dict[str, torch.Tensor] | None = None) -> PruneResult:
    """Cut the `round(fraction * intermediate_size)` least important channels (`mlp_channel_scores`) out of every
    layer's MLP: their gate and up rows and their down column go, so the matrices, and each product, shrink."""
    _check_fraction("fraction", fraction)
    model = _model(llm)
    size = model.config.intermediate_size
    drop = round(fraction * size)
    if drop >= size:
        raise ValueError(f"fraction {fraction} would remove all {size} MLP channels of each layer")
    orders = [mlp_channel_scores(layer.mlp, _rms(input_rms, f"layers.{i}.mlp.down_proj")).argsort()
              for i, layer in enumerate(model.layers)]
    removed, pruned, before = {}, 0, _counts(model)
    with torch.no_grad():
        for i, (layer, order) in enumerate(zip(model.layers, orders)):
            mlp = layer.mlp
            removed[i], keep = sorted(order[:drop].tolist()), order[drop:].sort().values
            pruned += mlp.gate_up_proj.weight.numel() + mlp.down_proj.weight.numel()
            _keep_rows(mlp.gate_up_proj, torch.cat((keep, keep + size)))
            _keep_columns(mlp.down_proj, keep)
            pruned -= mlp.gate_up_proj.weight.numel() + mlp.down_proj.weight.numel()
    _set_config(llm, intermediate_size=size - drop)
    return PruneResult(f"MLP channels {fraction:.0%}" + (" (calibrated)" if input_rms else ""), pruned, *before,
                       removed)


def head_scores(attn: Attention, o_input_rms: torch.Tensor | None = None) -> torch.Tensor:
    """Importance of each query head, `[num_heads]`: the norm of its columns of the output projection (a head whose
    output is scaled down to little before it joins the residual stream matters little), each column scaled by
    its measured input root-mean-square when given."""
    w = attn.o_proj.weight.detach()
    if o_input_rms is not None:
        w = w * o_input_rms
    return w.view(w.shape[0], attn.num_heads, attn.head_dim).norm(dim=(0, 2))


def prune_attention_heads(llm, per_group: int, input_rms: dict[str, torch.Tensor] | None = None) -> PruneResult:
    """Cut the `per_group` least important query heads (`head_scores`) out of each KV group of every layer.

    With grouped-query attention, query head h reads KV head h // group. Taking the same number of query heads
    from every group keeps the groups equal and in order, so the attention code and the KV cache (whose KV
    heads all stay) need no change: the head's rows of the q projection and its columns of o_proj go.
    """
    model = _model(llm)
    heads, kv_heads = model.config.num_heads, model.config.num_kv_heads
    group = heads // kv_heads
    if isinstance(per_group, bool) or not isinstance(per_group, int) or not 0 <= per_group < group:
        raise ValueError(f"per_group must be a whole number of query heads from 0 to {group - 1} "
                         f"(each KV group has {group}, and keeps at least one), got {per_group!r}")
    ranks = [head_scores(layer.self_attn, _rms(input_rms, f"layers.{i}.self_attn.o_proj")).view(kv_heads, group)
             .argsort(dim=1) for i, layer in enumerate(model.layers)]  # each group's heads, least important first
    offsets = torch.arange(kv_heads)[:, None] * group
    removed, pruned, before = {}, 0, _counts(model)
    with torch.no_grad():
        for i, (layer, rank) in enumerate(zip(model.layers, ranks)):
            attn = layer.self_attn
            removed[i] = sorted((rank[:, :per_group] + offsets).flatten().tolist())
            keep = (rank[:, per_group:] + offsets).flatten().sort().values
            rows = (keep[:, None] * attn.head_dim + torch.arange(attn.head_dim)).flatten()
            pruned += attn.qkv_proj.weight.numel() + attn.o_proj.weight.numel() + _numel(attn.qkv_proj.bias)
            _keep_rows(attn.qkv_proj, torch.cat((rows, torch.arange(attn.q_size, attn.qkv_proj.out_features))))
            _keep_columns(attn.o_proj, rows)
            pruned -= attn.qkv_proj.weight.numel() + attn.o_proj.weight.numel() + _numel(attn.qkv_proj.bias)
            attn.num_heads = len(keep)
            attn.q_size = attn.num_heads * attn.head_dim
    _set_config(llm, num_heads=heads - per_group * kv_heads)
    method = f"{per_group} of {group} query heads per KV group" + (" (calibrated)" if input_rms else "")
    return PruneResult(method, pruned, *before, removed)


def _check_fraction(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or not 0 <= value < 1:
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")


def _model(llm) -> CausalLM:
    """The engine's model, checked to be prunable now: plain linear layers, no request in flight."""
    if llm.engine.has_unfinished_requests():
        raise ValueError("the engine has unfinished requests; prune between runs, not during one")
    model = llm.engine.model
    for name, module in model.layers.named_modules():
        if name.endswith("_proj") and not isinstance(module, Linear):
            raise ValueError(f"layers.{name} is a {type(module).__name__}; prune before quantizing")
    return model


def _projections(model: CausalLM) -> list[tuple[str, Linear, list[int]]]:
    """Each decoder linear layer, by qualified name, with the row counts of the projections fused in it."""
    out = []
    for i, layer in enumerate(model.layers):
        attn, mlp, name = layer.self_attn, layer.mlp, f"layers.{i}."
        out += [(name + "self_attn.qkv_proj", attn.qkv_proj, [attn.q_size, attn.kv_size, attn.kv_size]),
                (name + "self_attn.o_proj", attn.o_proj, [attn.o_proj.out_features]),
                (name + "mlp.gate_up_proj", mlp.gate_up_proj, [mlp.gate_up_proj.out_features // 2] * 2),
                (name + "mlp.down_proj", mlp.down_proj, [mlp.down_proj.out_features])]
    return out


def _rms(input_rms: dict[str, torch.Tensor] | None, name: str) -> torch.Tensor | None:
    """The calibrated input root-mean-square of layer `name`, or None without calibration."""
    if input_rms is None:
        return None
    if name not in input_rms:
        raise ValueError(f"input_rms has no entry for {name}; calibrate this model before pruning it")
    return input_rms[name]


def _counts(model: CausalLM) -> tuple[int, int]:
    """(weights of the decoder layers' linear layers, every parameter of the model)."""
    linears = sum(linear.weight.numel() for _, linear, _ in _projections(model))
    return linears, sum(p.numel() for p in model.parameters())


def _apply_masks(llm, method: str, input_rms, mask_of) -> PruneResult:
    """Multiply each projection's weight by `mask_of(its scores)`, then repack and forget cached prefixes."""
    model = _model(llm)
    projections, masks = _projections(model), []
    for name, linear, rows in projections:  # every mask first, so a bad argument changes nothing
        rms = _rms(input_rms, name)
        scores = linear.weight.detach().abs() if rms is None else linear.weight.detach().abs() * rms
        masks.append([mask_of(part) for part in scores.split(rows)])
    pruned, before = 0, _counts(model)
    with torch.no_grad():
        for (_, linear, rows), parts in zip(projections, masks):
            for part, keep in zip(linear.weight.split(rows), parts):
                part.mul_(keep)
                pruned += int((~keep).sum())
            _repack(linear)
    llm.reset_prefix_cache()
    return PruneResult(method, pruned, *before)


def _keep_rows(linear: Linear, index: torch.Tensor) -> None:
    """Keep only the output rows `index` of a linear layer (weight and bias)."""
    linear.weight = nn.Parameter(linear.weight[index].contiguous(), requires_grad=linear.weight.requires_grad)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias[index].contiguous(), requires_grad=linear.bias.requires_grad)
    linear.out_features = len(index)
    _repack(linear)


def _keep_columns(linear: Linear, index: torch.Tensor) -> None:
    """Keep only the inputs `index` of a linear layer."""
    linear.weight = nn.Parameter(linear.weight[:, index].contiguous(), requires_grad=linear.weight.requires_grad)
    linear.in_features = len(index)
    _repack(linear)


def _repack(linear: Linear) -> None:
    """Rebuild the oneDNN copy the engine computes with, if the layer has one."""
    if linear.packed is not None:
        linear.pack()


def _numel(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel()


def _set_config(llm, **sizes) -> None:
    """Record the new sizes in the model's (and engine's) config, and forget prefixes cached before the cut."""
    llm.engine.config = llm.engine.model.config = replace(llm.engine.model.config, **sizes)
    llm.reset_prefix_cache()
