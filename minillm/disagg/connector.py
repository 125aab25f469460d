"""Chapter 9 — one side of the KV transfer between a prefill instance and a decode instance (vLLM's KV connector).

The prefill side (`kv_producer`) holds a finished prompt's blocks and hands out a `KVTransferParams`. The decode
side (`kv_consumer`) allocates blocks of its own and pulls exactly those it has no cached copy of: it sends a
pull (transfer id, first block, block count); the prefill side answers with a reply (found or gone, bytes), then
one message holding those blocks' keys and values (and scales) of every layer. The prefill side frees its blocks
once the message is sent; if no pull comes within `hold_timeout` seconds it frees them anyway, and a late pull is
told they are gone (the decode side then computes the prompt itself).

gloo's point-to-point operations can be waited on but not polled (`is_completed` stays False until `wait`), so
each side keeps one thread per peer that blocks on the wire: a decode instance pulls from several prefill
instances at once, a prefill instance answers several decode instances at once, and each side's engine keeps
stepping meanwhile. The engine step collects what they finished (`get_finished`, as in vLLM) and is alone in
changing blocks and queues.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from dataclasses import replace

import torch

from ..kv_cache import KVCache
from ..parallel.comm import Comm
from ..sampling import SamplingParams, TokenLogprobs
from ..sequence import Sequence
from ..kv_handoff import KVLayout, KVTransferParams
from .kv_transfer import TransferRecord

PRODUCER, CONSUMER = "kv_producer", "kv_consumer"  # vLLM's kv_role values
STOP = 0  # a pull of transfer 0 ends the prefill side's thread for that peer (transfer ids start at 1)
GONE, FOUND = 0, 1


def check_remote_decode(params: SamplingParams) -> None:
    """Refuse what a prefill for a remote decode cannot run: it stops after its first token, for one completion. A
    pair's coordinator checks this when a request is added, so no instance refuses a request from inside a step."""
    if params.n != 1:
        raise ValueError(f"a prefill for a remote decode runs one completion (n = 1, got {params.n}); the decode "
                         "instance runs all n")
    if params.min_tokens > 1:
        raise ValueError(f"min_tokens must be at most 1 with prefill/decode disaggregation, got {params.min_tokens}: "
                         "the prefill instance stops after the first token")


class KVConnector:
    """Holds (prefill side) or pulls (decode side) prompts' KV blocks over a `Comm` shared with its `peers`: the
    ranks of the other side's instances (default: the other rank of a group of two)."""

    def __init__(self, role: str, comm: Comm, kv_cache: KVCache, hold_timeout: float = 60.0,
                 peers: list[int] | None = None):
        if role not in (PRODUCER, CONSUMER):
            raise ValueError(f"role must be {PRODUCER!r} (prefill) or {CONSUMER!r} (decode), got {role!r}")
        self.role, self.comm, self.kv_cache, self.hold_timeout = role, comm, kv_cache, hold_timeout
        self.layout = KVLayout.of(kv_cache)
        self.peers = [1 - comm.rank] if peers is None else list(peers)
        self.transfers: list[TransferRecord] = []  # one per finished transfer, as this side saw it
        self.num_expired = 0  # held blocks freed because no pull came in time
        self._lock = threading.Lock()  # guards the two dicts: the threads take held requests, an abort releases one
        self._held: dict[int, tuple[Sequence, float]] = {}  # transfer id -> (finished prefill, since)
        self._held_ids: dict[str, int] = {}  # request id -> transfer id
        self._ids = itertools.count(STOP + 1)
        # decode side: per prefill instance, the (sequence, handle, first block) to pull from it
        self._pulls: dict[int, queue.SimpleQueue] = {peer: queue.SimpleQueue() for peer in self.peers}
        self._done: queue.SimpleQueue = queue.SimpleQueue()  # what the threads finished, for the next step
        self._error: BaseException | None = None
        self._threads = [threading.Thread(target=self._serve if role == PRODUCER else self._pull, args=(peer,),
                                          daemon=True, name=f"{role}-{peer}") for peer in self.peers]
        for t in self._threads:
            t.start()

    @property
    def num_held(self) -> int:
        return len(self._held)

    def check_request(self, token_ids: list[int], params: SamplingParams, do_remote_decode: bool,
                      remote_prefill: KVTransferParams | None) -> SamplingParams:
        """Refuse a prefill or decode for another instance that this side cannot do; the parameters to run it with
        (a prefill stops after its first token)."""
        if do_remote_decode == (remote_prefill is not None):
            raise ValueError("a request is either prefilled here for a remote decode or decoded after a remote "
                             "prefill, not both")
        role = PRODUCER if do_remote_decode else CONSUMER
        if role != self.role:
            raise ValueError(f"{'do_remote_decode' if do_remote_decode else 'remote_prefill'} needs the {role} side "
                             f"of a pair; this is the {self.role} side")
        if do_remote_decode:
            check_remote_decode(params)
            return replace(params, max_tokens=1)
        self.layout.check(remote_prefill.layout)
        if remote_prefill.prefill_rank not in self.peers:
            raise ValueError(f"remote_prefill names prefill rank {remote_prefill.prefill_rank}, which is not a peer "
                             f"of this instance ({self.peers})")
        if list(remote_prefill.prompt_token_ids) != token_ids:
            raise ValueError("the prompt differs from the one the prefill instance computed (remote_prefill)")
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs come from the prefill instance; ask for them there")
        return params

    # --- prefill side -------------------------------------------------------------------------------------------

    def request_finished(self, seq: Sequence, first_logprobs: TokenLogprobs | None = None) -> KVTransferParams:
        """Hold a finished prefill's blocks for the decode instance (vLLM's name); the handle to pull them with."""
        transfer_id = next(self._ids)
        handle = KVTransferParams(seq.request_id, list(seq.prompt_token_ids), seq.output_token_ids[0],
                                  seq.metrics.first_token_time, list(seq.block_table), self.layout, transfer_id,
                                  first_logprobs, None if seq.generator is None else seq.generator.get_state(),
                                  self.comm.rank)
        with self._lock:
            self._held[transfer_id] = (seq, time.perf_counter())
            self._held_ids[seq.request_id] = transfer_id
        return handle

    def release(self, request_id: str) -> Sequence | None:
        """Stop holding an aborted request's blocks: its sequence, for the caller to free; None when nothing is held
        (never handed over, pulled already, or being sent now: those blocks are freed when the send ends)."""
        with self._lock:
            held = self._held.pop(self._held_ids.pop(request_id, STOP), None)
        return None if held is None else held[0]

    def _take(self, transfer_id: int) -> Sequence | None:
        with self._lock:
            held = self._held.pop(transfer_id, None)
            if held is not None:
                del self._held_ids[held[0].request_id]
        return None if held is None else held[0]

    def _serve(self, peer: int) -> None:
        """The prefill side's thread for one decode instance: answer its pulls with the blocks they name, until it
        says stop."""
        try:
            header = torch.zeros(3, dtype=torch.long)
            while (pull := self.comm.recv(header, peer).tolist())[0] != STOP:
                transfer_id, first, count = pull
                start = time.perf_counter()
                seq = self._take(transfer_id)  # ours now: an abort or a timeout can no longer free it under us
                if seq is None:
                    self.comm.send(torch.tensor([GONE, 0]), peer, tag=transfer_id).wait()
                    continue
                block_ids = seq.block_table[first:first + count]
                data = self.kv_cache.pack_blocks(block_ids)
                self.comm.send(torch.tensor([FOUND, data.numel()]), peer, tag=transfer_id).wait()
                if data.numel():
                    self.comm.send(data, peer, tag=transfer_id).wait()
                record = TransferRecord(seq.request_id, len(block_ids), data.numel(), time.perf_counter() - start)
                self._done.put((seq, record))
        except BaseException as e:  # the engine step raises it
            self._error = e

    def _expired(self) -> list[Sequence]:
        """Held requests no pull came for within `hold_timeout` seconds."""
        now = time.perf_counter()
        with self._lock:
            old = [i for i, (_, since) in self._held.items() if now - since > self.hold_timeout]
        seqs = [seq for i in old if (seq := self._take(i)) is not None]
        self.num_expired += len(seqs)
        return seqs

    # --- decode side --------------------------------------------------------------------------------------------

    def start_load_kv(self, seq: Sequence) -> None:
        """Pull the K/V of a sequence that just got its blocks (vLLM's name): those after its prefix-cache hits."""
        self._pulls[seq.remote_prefill.prefill_rank].put((seq, seq.remote_prefill, len(seq.block_hashes)))

    def _pull(self, peer: int) -> None:
        """The decode side's thread for one prefill instance: make each pull from it in turn; at the end, tell that
        instance's thread for this one to stop."""
        try:
            while (job := self._pulls[peer].get()) is not None:
                seq, handle, first = job
                start, count, tag = time.perf_counter(), len(handle.block_ids) - first, handle.transfer_id
                self.comm.send(torch.tensor([tag, first, count]), peer).wait()
                found, nbytes = self.comm.recv(torch.zeros(2, dtype=torch.long), peer, tag).tolist()
                data = None
                if found:
                    if nbytes != count * self.layout.block_bytes:
                        raise RuntimeError(f"the prefill instance sent {nbytes} bytes for {count} blocks of "
                                           f"{self.layout.block_bytes}")
                    data = torch.empty(nbytes, dtype=torch.uint8)
                    if nbytes:
                        self.comm.recv(data, peer, tag)
                record = TransferRecord(handle.request_id, count, nbytes, time.perf_counter() - start)
                self._done.put((seq, first, data, record))
            self.comm.send(torch.tensor([STOP, 0, 0]), peer).wait()
        except BaseException as e:  # the engine step raises it
            self._error = e

    # --- both ---------------------------------------------------------------------------------------------------

    def get_finished(self) -> tuple[list[Sequence], list[tuple[Sequence, bool]]]:
        """What finished since the last call (vLLM's name). Prefill side: finished prefills whose blocks were pulled,
        or held too long: free them. Decode side: sequences whose pulls ended, each with whether its K/V are now
        installed in its blocks (False: the prefill side no longer had them). Raises if the transfer broke."""
        if self._error is not None:
            peer = "a decode" if self.role == PRODUCER else "a prefill"
            raise RuntimeError(f"the KV transfer with {peer} instance failed: {type(self._error).__name__}: "
                               f"{self._error}") from self._error
        sent, loaded = [], []
        while True:
            try:
                item = self._done.get_nowait()
            except queue.Empty:
                break
            if self.role == PRODUCER:
                sent.append(item[0])
                self.transfers.append(item[1])
                continue
            seq, first, data, record = item
            if data is not None:
                self.transfers.append(record)
                if not seq.is_finished:  # an aborted sequence's blocks are free already
                    self.kv_cache.unpack_blocks(seq.block_table[first:], data)
            loaded.append((seq, data is not None))
        if self.role == PRODUCER:
            sent += self._expired()
        return sent, loaded

    def close(self) -> None:
        """End the decode side's threads, and through them the prefill side's threads for this instance (which
        otherwise end when this instance's process does). Idempotent."""
        if self.role == CONSUMER:
            for peer, t in zip(self.peers, self._threads):
                if t.is_alive():
                    self._pulls[peer].put(None)
            for t in self._threads:
                t.join(timeout=5)
