"""Chapter 7 — every collective of minillm's parallel code goes through `Comm`, which counts the bytes each rank
sends and the time it waits, so that communication is measured rather than guessed; and `run_group`, which
starts a group of worker processes that talk over loopback only.
"""

from __future__ import annotations

import io
import os
import pickle
import socket
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..ports import free_port


@dataclass
class OpStats:
    """One kind of collective on one rank: how often it ran, the bytes this rank sent, the seconds it took."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


class Comm:
    """The collectives of one process group, timed and counted per operation (`stats`)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group or dist.group.WORLD  # a group made with or without `init_process_group`
        self.rank, self.world_size = self.group.rank(), self.group.size()
        self.stats: dict[str, OpStats] = defaultdict(OpStats)

    def _record(self, op: str, nbytes: int, start: float) -> None:
        s = self.stats[op]
        s.calls, s.bytes, s.seconds = s.calls + 1, s.bytes + nbytes, s.seconds + time.perf_counter() - start

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place (a ring all-reduce sends about 2 (P - 1) / P of its bytes)."""
        start = time.perf_counter()
        dist.all_reduce(t, group=self.group)
        self._record("all_reduce", 2 * (self.world_size - 1) * t.nbytes // self.world_size, start)
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `t` (all the same shape), in rank order."""
        start = time.perf_counter()
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(out, t, group=self.group)
        self._record("all_gather", (self.world_size - 1) * t.nbytes, start)
        return out

    def gather(self, t: torch.Tensor, dst: int = 0) -> list[torch.Tensor] | None:
        """Every rank's `t` (all the same shape) in rank order, on rank `dst` only (None elsewhere)."""
        start = time.perf_counter()
        out = [torch.empty_like(t) for _ in range(self.world_size)] if self.rank == dst else None
        dist.gather(t, out, group_dst=dst, group=self.group)
        self._record("gather", 0 if self.rank == dst else t.nbytes, start)
        return out

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s `t`, copied into `t` on every rank."""
        start = time.perf_counter()
        dist.broadcast(t, group_src=src, group=self.group)
        self._record("broadcast", t.nbytes if self.rank == src else 0, start)
        return t

    def broadcast_object(self, obj=None, src: int = 0):
        """Rank `src`'s picklable `obj` on every rank: its length, then its bytes (a step plan, say)."""
        if self.rank == src:
            data = _encode(obj)
            self.broadcast(torch.tensor([data.numel()]), src)
            self.broadcast(data, src)
            return obj
        size = self.broadcast(torch.zeros(1, dtype=torch.long), src)
        return _decode(self.broadcast(torch.empty(int(size), dtype=torch.uint8), src))

    def send_object(self, obj, dst: int) -> None:
        """Send a picklable `obj` to rank `dst` (which calls `recv_object`)."""
        data = _encode(obj)
        self.send(torch.tensor([data.numel()]), dst).wait()
        self.send(data, dst).wait()

    def recv_object(self, src: int):
        size = self.recv(torch.zeros(1, dtype=torch.long), src)
        return _decode(self.recv(torch.empty(int(size), dtype=torch.uint8), src))

    def all_to_all(self, t: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Rows `t` split by `send_counts` (rows for rank 0, 1, ...); the rows every rank sent here, in rank
        order (`recv_counts` of them from each). The dispatch and combine of expert parallelism."""
        start = time.perf_counter()
        out = t.new_empty((sum(recv_counts), *t.shape[1:]))
        self.group.alltoall_base(out, t.contiguous(), recv_counts, send_counts).wait()
        row = t[0].nbytes if t.shape[0] else 0
        self._record("all_to_all", (sum(send_counts) - send_counts[self.rank]) * row, start)
        return out

    def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> dist.Work:
        """Start sending `t` to rank `dst`; the returned handle's `wait()` finishes it. A receive matches the sends
        of its `tag` in order."""
        start = time.perf_counter()
        work = dist.isend(t, group_dst=dst, group=self.group, tag=tag)
        self._record("send", t.nbytes, start)
        return work

    def recv(self, t: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        """Fill `t` with what rank `src` sends with `tag` (the time counted is the time waited)."""
        start = time.perf_counter()
        dist.irecv(t, group_src=src, group=self.group, tag=tag).wait()
        self._record("recv", 0, start)
        return t

    def start_send_recv(self, send: torch.Tensor, recv: torch.Tensor, dst: int, src: int,
                        tag: int = 0) -> Callable[[], torch.Tensor]:
        """Start sending `send` to rank `dst` and receiving `recv` from rank `src`, and return at once; the function
        returned waits for both and gives `recv` (the time counted is the time it waits). A ring step starts its
        transfer this way, then computes while the bytes travel."""
        requests = [dist.isend(send, group_dst=dst, group=self.group, tag=tag),
                    dist.irecv(recv, group_src=src, group=self.group, tag=tag)]

        def wait() -> torch.Tensor:
            start = time.perf_counter()
            for request in requests:
                request.wait()
            self._record("send_recv", send.nbytes, start)
            return recv

        return wait

    def send_recv(self, send: torch.Tensor, recv: torch.Tensor, dst: int, src: int) -> torch.Tensor:
        """Send `send` to rank `dst` while receiving `recv` (same shape on the sender) from rank `src`: one step of
        a ring, where every rank passes what it holds to its neighbour."""
        return self.start_send_recv(send, recv, dst, src)()


def _encode(obj) -> torch.Tensor:
    """A picklable object as a byte tensor, for the `*_object` exchanges."""
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _decode(data: torch.Tensor):
    return pickle.loads(data.numpy().tobytes())


def loopback_store(rank: int, world_size: int, port: int) -> dist.TCPStore:
    """The group's rendezvous store on 127.0.0.1:`port`. Rank 0 serves it from a socket it binds to loopback
    itself: a TCPStore left to bind its own listens on every interface of the machine."""
    listener = None
    if rank == 0:
        listener = socket.socket()
        listener.bind(("127.0.0.1", port))
        listener.listen()
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0,
                          master_listen_fd=None if listener is None else listener.detach())
    return store


def _worker(rank: int, world_size: int, port: int, fn, args: tuple, results) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's own connections: loopback only
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, store=loopback_store(rank, world_size, port))
    try:
        value = fn(Comm(), *args)
    except BaseException as e:  # reported to the parent, which raises it
        value = RuntimeError(f"rank {rank}: {type(e).__name__}: {e}")
    # as plain bytes: a tensor put on the queue as it is travels as a handle to this process's shared memory,
    # which the parent could no longer open once this process has exited
    buffer = io.BytesIO()
    torch.save(value, buffer)
    results.put((rank, buffer.getvalue()))  # before tearing down: a peer that left first must not lose this
    try:
        dist.destroy_process_group()
    except RuntimeError:
        pass


def run_group(fn, world_size: int, *args, timeout: float = 120.0) -> list:
    """Run `fn(comm, *args)` on `world_size` new processes joined in a gloo group on 127.0.0.1; their return values
    in rank order. Every process is stopped before this returns, whether the ranks succeed, raise or hang."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results, port = ctx.SimpleQueue(), free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        deadline, out = time.monotonic() + timeout, {}
        while len(out) < world_size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {world_size} ranks did not finish within {timeout:.0f} s")
            if not results.empty():
                rank, data = results.get()
                out[rank] = torch.load(io.BytesIO(data), weights_only=False)
            elif any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError("a rank exited without a result")
            else:
                time.sleep(0.01)
        errors = [v for v in out.values() if isinstance(v, RuntimeError)]
        if errors:
            raise errors[0]
        return [out[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


def time_all_reduce(comm: Comm, sizes_bytes: list[int], repeats: int = 20) -> list[dict[str, float]]:
    """Median seconds of one all-reduce of float32 tensors of each size on this group (every rank must call it
    with the same arguments), with the bus bandwidth that implies: 2 (P - 1) / P of the bytes cross each link."""
    rows = []
    for nbytes in sizes_bytes:
        t = torch.ones(max(1, nbytes // 4))
        for _ in range(3):
            dist.all_reduce(t, group=comm.group)
        times = []
        for _ in range(repeats):
            dist.barrier(group=comm.group)
            start = time.perf_counter()
            dist.all_reduce(t, group=comm.group)
            times.append(time.perf_counter() - start)
        seconds = sorted(times)[len(times) // 2]
        rows.append({"bytes": t.nbytes, "seconds": seconds,
                     "bus_gb_s": 2 * (comm.world_size - 1) / comm.world_size * t.nbytes / seconds / 1e9})
    return rows
