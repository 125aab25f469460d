"""Chapter 10 — a KV offload tier: prefix-cache blocks that the device pool evicts are copied to a larger, slower
memory (a memory-mapped file on local disk, or pinned host memory beside a GPU), and a later prompt that starts the
same way reloads them instead of recomputing them.

The tier is fixed slots of one block each, indexed by block hash and reused least recently used first. A slot holds
a header (the block's chained hash, the pool's layout, and a CRC-32 of those and of the block's bytes) and then the
block's keys and values of every layer, scales included for an int8 or fp8 pool, as `KVCache.pack_blocks` lays
them out. A load checks all of it: a slot torn by a partial write, overwritten, or corrupted on disk is refused
(counted) and its block recomputed, never used. The block manager calls `store` when it hands out a cached block
for new contents, and `lookup` then `load` when a prompt's block misses the pool; both run between forward
passes, before the block is written, so no copy races the model.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import tempfile
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Collection
from pathlib import Path

import numpy as np
import torch

from .cache_dir import cache_dir
from .kv_cache import KVCache
from .kv_handoff import KVLayout

KV_OFFLOADING_BACKENDS = ("native", "file", "host")  # native: the file on a CPU, pinned host memory on a GPU
GIB = 1 << 30  # kv_offloading_size is in GiB, as vLLM's
MAGIC = b"MKV1"
LAYOUT = struct.Struct("<16s4I?")  # the pool's dtype, block size, layers, KV heads, head dim, quantized
HEADER = struct.Struct(f"<4sI32s{LAYOUT.size}s")  # magic, CRC-32, block hash, layout
HEADER_BYTES = 128  # room for the header; the block's bytes follow
SLOT_ALIGN = 4096  # slots start on page boundaries of the mapping

log = logging.getLogger("minillm")


def slot_bytes(layout: KVLayout) -> int:
    """Bytes one slot takes: its header and one block of every layer, rounded up to whole pages."""
    return -(-(HEADER_BYTES + layout.block_bytes) // SLOT_ALIGN) * SLOT_ALIGN


def offload_stats(tier: KVOffloadTier | None) -> dict:
    """The tier's counters for `LLMEngine.stats` (zeros without a tier)."""
    if tier is None:
        return dict.fromkeys(("kv_offload_blocks_stored", "kv_offload_blocks_loaded", "kv_offload_load_failures",
                              "kv_offload_bytes_used", "kv_offload_bytes_total"), 0)
    return {"kv_offload_blocks_stored": tier.num_stored, "kv_offload_blocks_loaded": tier.num_loaded,
            "kv_offload_load_failures": tier.num_failed, "kv_offload_bytes_used": len(tier.slots) * tier.slot_bytes,
            "kv_offload_bytes_total": tier.num_slots * tier.slot_bytes}


class KVOffloadTier:
    """A second tier for one `KVCache`: `size_bytes` of fixed slots, on `backend` ("file": a memory-mapped file in
    `directory`, default `$MINILLM_CACHE/kv_offload`; "host": host memory, pinned when the pool is on a GPU;
    "native": the file on a CPU, pinned host memory on a GPU)."""

    def __init__(self, kv_cache: KVCache, size_bytes: int, backend: str = "native", directory: Path | None = None):
        if backend not in KV_OFFLOADING_BACKENDS:
            raise ValueError(f"kv_offloading_backend {backend!r} is not supported; use one of {KV_OFFLOADING_BACKENDS}")
        on_gpu = kv_cache.k.device.type == "cuda"
        self.kv_cache, self.layout = kv_cache, KVLayout.of(kv_cache)
        self.backend = ("host" if on_gpu else "file") if backend == "native" else backend
        self.slot_bytes = slot_bytes(self.layout)
        self.num_slots = size_bytes // self.slot_bytes
        if self.num_slots < 1:
            raise ValueError(f"kv_offloading_size ({size_bytes} bytes) holds no block: one slot takes "
                             f"{self.slot_bytes} bytes ({self.slot_bytes / GIB:.3g} GiB)")
        nbytes = self.num_slots * self.slot_bytes
        self.path: Path | None = None
        if self.backend == "file":
            self.path, self.buffer = _mapped_file(directory or cache_dir() / "kv_offload", nbytes)
            self._remove = weakref.finalize(self, _remove, self.path)  # at close, collection or exit
        else:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=on_gpu)
        self._bytes = self.buffer.numpy()  # the same memory, for checksums and headers
        self._layout = LAYOUT.pack(self.layout.dtype.encode(), self.layout.block_size, self.layout.num_layers,
                                   self.layout.num_kv_heads, self.layout.head_dim, self.layout.quantized)
        self.slots: OrderedDict[bytes, int] = OrderedDict()  # block hash -> slot, least recently used first
        self.free_slots = list(range(self.num_slots))[::-1]
        self.num_stored = self.num_loaded = self.num_failed = 0

    def lookup(self, block_hash: bytes) -> bool:
        """Whether a block with this hash is here; if so it becomes the last to be evicted."""
        if block_hash not in self.slots:
            return False
        self.slots.move_to_end(block_hash)
        return True

    def store(self, block_hash: bytes, block_id: int, keep: Collection[bytes] = ()) -> None:
        """Copy block `block_id` of the pool (every layer) into a slot under `block_hash`, evicting the least
        recently used slot when none is free, but never one of `keep` (blocks about to be reloaded, which matter
        more: if every slot is one of them, the block is not stored). The bytes go first and the header last, so a
        write torn midway leaves a header whose checksum does not match."""
        if self.lookup(block_hash):
            return  # reloaded from here and unchanged since: the slot still holds it
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            victim = next((h for h in self.slots if h not in keep), None)
            if victim is None:
                return
            slot = self.slots.pop(victim)
        data = self.kv_cache.pack_blocks([block_id]).numpy()
        start = slot * self.slot_bytes
        self._bytes[start + HEADER_BYTES:start + HEADER_BYTES + data.size] = data
        self._bytes[start:start + HEADER.size] = np.frombuffer(self._header(block_hash, data), dtype=np.uint8)
        self.slots[block_hash] = slot
        self.num_stored += 1

    def load(self, block_hash: bytes, block_id: int) -> bool:
        """Copy the block stored under `block_hash` into block `block_id` of the pool. False, the pool unchanged,
        when it is not here, or when its slot fails the checks (then the slot is dropped and the failure counted)."""
        slot = self.slots.get(block_hash)
        if slot is None:
            return False
        start = slot * self.slot_bytes
        data = self._bytes[start + HEADER_BYTES:start + HEADER_BYTES + self.layout.block_bytes]
        if self._bytes[start:start + HEADER.size].tobytes() != self._header(block_hash, data):
            log.warning("KV offload: slot %d failed its checks (torn, stale or corrupted); its block is recomputed",
                        slot)
            del self.slots[block_hash]
            self.free_slots.append(slot)
            self.num_failed += 1
            return False
        self.kv_cache.unpack_blocks([block_id], self.buffer[start + HEADER_BYTES:start + HEADER_BYTES + data.size])
        self.slots.move_to_end(block_hash)
        self.num_loaded += 1
        return True

    def clear(self) -> None:
        """Forget every stored block (`reset_prefix_cache`)."""
        self.slots.clear()
        self.free_slots = list(range(self.num_slots))[::-1]

    def close(self) -> None:
        """Remove the file (its memory goes when the tier is collected); nothing to do in host memory."""
        if self.path is not None:
            self._remove()

    def _header(self, block_hash: bytes, data: np.ndarray) -> bytes:
        """The header a slot holding `data` under `block_hash` carries: its CRC-32 covers hash, layout and bytes."""
        crc = zlib.crc32(data, zlib.crc32(self._layout, zlib.crc32(block_hash)))
        return HEADER.pack(MAGIC, crc, block_hash, self._layout)


def _mapped_file(directory: Path, nbytes: int) -> tuple[Path, torch.Tensor]:
    """A new file of `nbytes` in `directory`, its disk space reserved now (a full disk is an error here, not a crash
    at a later write into the mapping), mapped shared into memory as a uint8 tensor."""
    directory.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix="kv-offload-", suffix=".bin", dir=directory)
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, nbytes)
        else:
            os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes)
    except OSError as e:
        _remove(Path(name))
        raise ValueError(f"kv_offloading_size: cannot reserve {nbytes} bytes in {directory}: {e}") from None
    finally:
        os.close(fd)
    return Path(name), torch.frombuffer(mapping, dtype=torch.uint8)


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:  # gone already, or (Windows) still mapped
        pass


def time_tier(config, block_size: int, blocks: int, backend: str = "native") -> dict:
    """Measured on a pool and a tier of `blocks` blocks of this model's layout (float32 on the CPU, random keys and
    values): seconds per block to store and to reload (checksum checked), and the raw read bandwidth of the tier's
    memory in bytes/s (a file just written is read from the page cache)."""
    from .roofline import time_median

    pool = KVCache.allocate(config, blocks, block_size, torch.float32, "cpu")
    pool.k.copy_(torch.randn_like(pool.k))
    pool.v.copy_(torch.randn_like(pool.v))
    tier = KVOffloadTier(pool, blocks * slot_bytes(KVLayout.of(pool)), backend)
    hashes = [i.to_bytes(32, "little") for i in range(blocks)]

    def store_all() -> None:
        tier.clear()
        for b, h in enumerate(hashes):
            tier.store(h, b)

    def load_all() -> None:
        for b, h in enumerate(hashes):
            assert tier.load(h, (b + 1) % blocks)

    store = time_median(store_all, repeats=5, warmup=1) / blocks
    load = time_median(load_all, repeats=5, warmup=1) / blocks
    scratch = torch.empty_like(tier.buffer)
    read = tier.buffer.numel() / time_median(lambda: scratch.copy_(tier.buffer), repeats=5)
    tier.close()
    return {"store_s": store, "load_s": load, "read_bytes_s": read}
