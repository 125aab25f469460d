"""Chapter 6 — distillation: a smaller model (the student) trained to predict what a larger one (the teacher)
predicts.

The student here is the teacher with some decoder layers taken out, so it starts close to the teacher (every
weight it has is the teacher's) and needs only a short training to recover part of what the missing layers
did. It learns from the teacher's next-token distribution at every position (soft targets: how likely each
candidate token was, not only which one came next), which says far more per token than the text alone.

Training is not what this book teaches, so the trainable model is transformers' own `LlamaForCausalLM`, the
optimizer plain AdamW; the student is saved as a Hugging Face directory that `minillm.LLM(model=...)` serves.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .weights import resolve_model


@dataclass
class Targets:
    """The teacher's log-probabilities (at `temperature`) of its `k` likeliest tokens at every position of every
    window, those tokens' ids, and the log-probability of all the other tokens together.

    A 49152-token vocabulary stored in full would take 100 KB per position in float16; the top k and one
    number for the rest keep what the loss needs at a few hundred bytes.
    """

    logprobs: torch.Tensor  # [windows, length, k] float32
    indices: torch.Tensor   # [windows, length, k] token ids
    rest: torch.Tensor      # [windows, length] log-probability of every token outside the top k
    temperature: float

    def __getitem__(self, index) -> "Targets":
        """The targets of some windows."""
        return Targets(self.logprobs[index], self.indices[index], self.rest[index], self.temperature)


@dataclass
class DistillResult:
    """What a `distill` run did: steps taken, seconds spent, the loss of each step, the layers trained."""

    steps: int
    seconds: float
    losses: list[float]  # distillation loss (plus ce_weight times the next-token loss) of each step
    trained_layers: list[int] | None  # student layer indices; None when every parameter trained


def load_teacher(model=None) -> nn.Module:
    """The model's Hugging Face checkpoint (`resolve_model(model)`) as a float32 transformers model, in eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(resolve_model(model)), dtype=torch.float32).eval()


def token_windows(token_ids: list[int], length: int) -> torch.Tensor:
    """Consecutive, non-overlapping windows of `length` tokens, `[n, length]` (a shorter tail is dropped)."""
    if not isinstance(length, int) or length < 2:
        raise ValueError(f"window length must be an integer >= 2, got {length!r}")
    n = len(token_ids) // length
    if n == 0:
        raise ValueError(f"{len(token_ids)} tokens do not fill one window of {length}")
    return torch.tensor(token_ids[:n * length]).view(n, length)


@torch.no_grad()
def layer_redundancy(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """How little each decoder layer changes its input: the mean cosine similarity of the hidden state before and
    after it over every token of `windows`, `[num_layers]`. The layers closest to 1 are the cheapest to drop
    (ShortGPT's "block influence" is one minus this)."""
    layers = model.model.layers
    sums = torch.zeros(len(layers))

    def record(i):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            sums[i] += F.cosine_similarity(args[0], out, dim=-1).sum()
        return hook

    handles = [layer.register_forward_hook(record(i)) for i, layer in enumerate(layers)]
    try:
        model(windows)
    finally:
        for handle in handles:
            handle.remove()
    return sums / windows.numel()


def drop_layers(teacher: nn.Module, layers: Iterable[int]) -> nn.Module:
    """A copy of `teacher` without the decoder layers `layers` (the teacher's indices), ready to train."""
    layers = sorted(set(layers))
    total = teacher.config.num_hidden_layers
    if not layers or not all(isinstance(i, int) and 0 <= i < total for i in layers) or len(layers) >= total:
        raise ValueError(f"layers to drop must be a non-empty list of indices in [0, {total}) "
                         f"leaving at least one layer, got {layers}")
    student = copy.deepcopy(teacher)
    kept = [layer for i, layer in enumerate(student.model.layers) if i not in layers]
    student.model.layers = nn.ModuleList(kept)
    for i, layer in enumerate(kept):
        layer.self_attn.layer_idx = i  # the index its KV cache entry is stored under
    student.config.num_hidden_layers = len(kept)
    if getattr(student.config, "layer_types", None):
        student.config.layer_types = [t for i, t in enumerate(student.config.layer_types) if i not in layers]
    return student


def neighbours(dropped: Iterable[int], num_layers: int) -> list[int]:
    """The student's indices of the layers that sat just before and just after a dropped one in the teacher
    (of `num_layers`): the layers that now feed one another without the removed layer between them."""
    dropped = set(dropped)
    kept = [i for i in range(num_layers) if i not in dropped]
    return [s for s, i in enumerate(kept) if i - 1 in dropped or i + 1 in dropped]


@torch.no_grad()
def teacher_targets(teacher: nn.Module, windows: torch.Tensor, top_k: int = 64, temperature: float = 1.0) -> Targets:
    """Run the teacher once over every window; keep the log-probabilities of its `top_k` likeliest tokens at each
    position, softened by `temperature` (above 1 the unlikely tokens' share grows: more to learn from)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature!r}")
    if not 1 <= top_k <= teacher.config.vocab_size:
        raise ValueError(f"top_k must be between 1 and the vocabulary's {teacher.config.vocab_size}, got {top_k}")
    parts = []
    for window in windows:
        logits = teacher(window[None]).logits[0]
        indices = logits.topk(top_k, dim=-1).indices
        parts.append((*_top_and_rest(logits, indices, temperature), indices))
    logprobs, rest, indices = (torch.stack(p) for p in zip(*parts))
    return Targets(logprobs, indices, rest, temperature)


def _top_and_rest(logits: torch.Tensor, indices: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities at `temperature` of the tokens `indices`, and of all the others together (at least
    e^-100, so that an empty rest, when `indices` is the whole vocabulary, adds 0 rather than NaN)."""
    scaled = logits.float() / temperature
    total = scaled.logsumexp(-1)
    rest = scaled.scatter(-1, indices, float("-inf")).logsumexp(-1)
    return scaled.gather(-1, indices) - total[..., None], (rest - total).clamp(min=-100.0)


def distill_loss(student_logits: torch.Tensor, targets: Targets) -> torch.Tensor:
    """KL(teacher || student) at the targets' temperature, times temperature² (Hinton's scaling), per token.

    Both distributions are seen as k + 1 outcomes, the teacher's top k tokens and everything else: this is
    the full KL divergence with the tail lumped together, zero only when the student matches the teacher on
    the top k and on the probability left to the rest.
    """
    q_top, q_rest = _top_and_rest(student_logits, targets.indices, targets.temperature)
    p_top, p_rest = targets.logprobs, targets.rest
    kl = (p_top.exp() * (p_top - q_top)).sum(-1) + p_rest.exp() * (p_rest - q_rest)
    return kl.mean() * targets.temperature ** 2


def distill(student: nn.Module, windows: torch.Tensor, targets: Targets, *, steps: int | None = None,
            seconds: float | None = None, lr: float = 1e-4, ce_weight: float = 0.0,
            train_layers: list[int] | None = None, batch_size: int = 1, seed: int = 0) -> DistillResult:
    """Train `student` in place on `targets` (from `teacher_targets` over the same `windows`) with AdamW.

    Stops after `steps` steps or before a step that would end past `seconds`, whichever comes first; windows
    are visited in a shuffled order, reshuffled each pass. `ce_weight` adds that much of the ordinary
    next-token loss on the text; `train_layers` (student layer indices) trains only those layers' weights,
    which also shortens the backward pass to the earliest of them; `None` trains every parameter.
    """
    if steps is None and seconds is None:
        raise ValueError("give a number of steps, a time budget in seconds, or both")
    if windows.shape[:2] != targets.indices.shape[:2]:
        raise ValueError(f"targets cover {tuple(targets.indices.shape[:2])} windows x positions, "
                         f"windows are {tuple(windows.shape)}")
    if not 1 <= batch_size <= len(windows):
        raise ValueError(f"batch_size must be between 1 and the {len(windows)} windows, got {batch_size}")
    layers = student.model.layers
    if train_layers is not None and not all(isinstance(i, int) and 0 <= i < len(layers) for i in train_layers):
        raise ValueError(f"train_layers must be student layer indices in [0, {len(layers)}), got {train_layers}")
    for p in student.parameters():
        p.requires_grad_(train_layers is None)
    if train_layers is not None:
        for i in train_layers:
            layers[i].requires_grad_(True)
    optimizer = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    order, rng = [], random.Random(seed)
    losses, start, last = [], time.perf_counter(), 0.0
    student.train()
    while (steps is None or len(losses) < steps) and (seconds is None or time.perf_counter() - start + last <= seconds):
        began = time.perf_counter()
        if len(order) < batch_size:
            order += rng.sample(range(len(windows)), len(windows))
        batch, order = order[:batch_size], order[batch_size:]
        logits = student(windows[batch]).logits
        loss = distill_loss(logits, targets[batch])
        if ce_weight:
            loss = loss + ce_weight * F.cross_entropy(logits[:, :-1].flatten(0, 1), windows[batch, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in student.parameters() if p.requires_grad], 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        last = time.perf_counter() - began
    student.eval()
    student.requires_grad_(False)
    return DistillResult(len(losses), time.perf_counter() - start, losses, train_layers)


def save_student(student: nn.Module, out: str | Path, tokenizer_from=None) -> Path:
    """Save `student` as a Hugging Face directory (config, safetensors, generation config) with the tokenizer of
    `tokenizer_from` (`resolve_model`'s argument: default the default model), so `minillm.LLM(model=out)` loads it."""
    from transformers import AutoTokenizer

    out = Path(out)
    student.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(resolve_model(tokenizer_from))).save_pretrained(out)
    return out
