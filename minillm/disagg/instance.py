"""Chapter 9 — one engine of a prefill/decode pool, in a process of its own (vLLM's engine-core busy loop).

The process builds its engine, joins the pool's gloo group with its KV connector, then loops: take the
coordinator's commands, run one engine step, send back its outputs, and its load when that changed. Between
commands it still steps every few milliseconds, so pulled blocks are freed and installed ones start decoding. It
stops on the coordinator's word, when the coordinator's process dies (the kernel signals it), or on any error,
which it reports first.
"""

from __future__ import annotations

import os
import queue
import traceback
from multiprocessing.connection import Connection

from ..engine_args import EngineArgs
from ..parallel.worker import die_with_parent
from .connector import CONSUMER, PRODUCER, KVConnector
from .kv_transfer import pd_comm

PREFILL, DECODE = "prefill", "decode"
ADD, ABORT, STATS, RESET_PREFIX_CACHE, STOP = "add", "abort", "stats", "reset_prefix_cache", "stop"
IDLE_WAIT_S = 0.002  # how long an idle instance waits for a command before stepping again
LOAD_FIELDS = ("num_waiting", "num_running", "num_waiting_for_remote_kvs", "kv_blocks_free", "num_preemptions",
               "prefix_cache_hit_tokens", "prefix_cache_query_tokens")  # what a load report holds


def instance_main(role: str, args: EngineArgs, rank: int, world_size: int, peers: list[int], port: int,
                  parent_pid: int, hold_timeout: float, commands, results: Connection) -> None:
    """The life of a `role` ("prefill" or "decode") instance, rank `rank` of the pool's group, whose other side is
    `peers`: build, join the pool, serve until told to stop."""
    from ..engine import LLMEngine  # here: the engine imports this package

    die_with_parent(parent_pid)
    engine = None
    try:
        engine = LLMEngine(args)
        engine.kv_connector = KVConnector(PRODUCER if role == PREFILL else CONSUMER,
                                          pd_comm(rank, world_size, port), engine.kv_cache, hold_timeout, peers)
        results.send(("ready", engine.stats()))
        _serve(engine, commands, results)
    except BaseException as e:  # named in the coordinator's error, with the innermost frames
        results.send(("error", f"the {role} instance failed: {''.join(traceback.format_exception(e, limit=-2))}"))
        os._exit(1)
    finally:
        if engine is not None:
            engine.shutdown()


def load(engine) -> dict:
    """What the coordinator needs to route and admit: queue lengths, free blocks, cache counters."""
    stats = engine.stats()
    return {k: stats[k] for k in LOAD_FIELDS}


def _serve(engine, commands, results: Connection) -> None:
    idle, reported = False, None
    while True:
        try:
            message = commands.get(timeout=IDLE_WAIT_S) if idle else commands.get_nowait()
        except queue.Empty:
            message = None
        while message is not None:
            if message[0] == STOP:
                return
            _apply(engine, message, results)
            try:
                message = commands.get_nowait()
            except queue.Empty:
                message = None
        outputs = engine.step()
        if outputs:
            results.send(("outputs", outputs))
        if (now := load(engine)) != reported:
            results.send(("load", now))
            reported = now
        idle = not outputs


def _apply(engine, message: tuple, results: Connection) -> None:
    kind, *rest = message
    if kind == ADD:
        request_id, token_ids, params, arrival_time, kv = rest
        try:
            engine.add_request(request_id, token_ids, params, arrival_time, do_remote_decode=kv is True,
                               remote_prefill=None if kv is True else kv)
        except ValueError as e:  # the coordinator raises it for this request
            results.send(("rejected", (request_id, str(e))))
    elif kind == ABORT:
        if (out := engine.abort(rest[0])) is not None:
            results.send(("outputs", [out]))
    elif kind == STATS:
        connector = engine.kv_connector
        results.send(("stats", {**engine.stats(), "transfers": list(connector.transfers),
                                "comm": dict(connector.comm.stats), "num_kv_held": connector.num_held,
                                "num_kv_expired": connector.num_expired}))
    elif kind == RESET_PREFIX_CACHE:
        engine.reset_prefix_cache()
