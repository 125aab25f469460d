"""Chapter 7 — one rank's place in a parallel layout: its groups (all ranks; its stage's tensor-parallel
ranks), made without `init_process_group`, so an `LLM` can start and stop its group as often as a notebook
likes."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .comm import Comm, loopback_store
from .config import ParallelConfig


@dataclass
class ParallelContext:
    """What a shardable layer needs to know about the rank it runs on."""

    config: ParallelConfig
    rank: int
    world: Comm  # every rank: activations between pipeline stages, logits to rank 0
    tp: Comm | None  # this stage's tensor-parallel ranks; None when there is one
    control: Comm  # every rank, on the CPU: step plans from rank 0 (kept apart, so `world` counts only data)

    @property
    def tp_rank(self) -> int:
        return self.config.tp_rank(self.rank)

    @property
    def tp_size(self) -> int:
        return self.config.tensor_parallel_size

    @property
    def pp_rank(self) -> int:
        return self.config.pp_rank(self.rank)

    @property
    def pp_size(self) -> int:
        return self.config.pipeline_parallel_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_peer(self, pp_rank: int) -> int:
        """The rank with this rank's tensor-parallel position in stage `pp_rank` (whom activations go to)."""
        return pp_rank * self.tp_size + self.tp_rank

    def layers(self, num_layers: int) -> range:
        return self.config.layer_range(num_layers, self.pp_rank)


def new_group(backend: str, store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
    """A process group of `size` ranks over `store`; gloo's connections on the loopback interface only."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(interface="lo")]
    return dist.ProcessGroupGloo(store, rank, size, options)


def init_parallel(config: ParallelConfig, rank: int, port: int, device: torch.device,
                  timeout: float = 300.0) -> ParallelContext:
    """Join the layout's groups as `rank` (rendezvous on 127.0.0.1:`port`, served by rank 0): NCCL between
    GPUs, gloo between CPU processes."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    wait = timedelta(seconds=timeout)
    store = loopback_store(rank, config.world_size, port)
    world = Comm(new_group(backend, dist.PrefixStore("world", store), rank, config.world_size, wait))
    control = Comm(new_group("gloo", dist.PrefixStore("control", store), rank, config.world_size, wait))
    tp = None
    if config.tensor_parallel_size > 1:
        stage = config.pp_rank(rank)
        tp = Comm(new_group(backend, dist.PrefixStore(f"tp{stage}", store), config.tp_rank(rank),
                         config.tensor_parallel_size, wait))
    return ParallelContext(config, rank, world, tp, control)
