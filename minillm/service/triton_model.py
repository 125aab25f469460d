"""Chapter 9 — minillm's engine behind NVIDIA Triton Inference Server (through PyTriton), batched by Triton's
dynamic batcher: requests that arrive within `max_queue_delay` are grouped and run to completion together
(request-level batching), where minillm's own scheduler admits and retires requests at every step.

Triton batches only tensors of one shape, so a client pads each prompt to the model's `prompt_width` with
`PAD` (as a static batcher would); the answer comes back the same way, padded to its longest row.
`pip install minillm[triton]` (nvidia-pytriton) brings the server binary and its Python backend.
"""

from __future__ import annotations

import os
import sysconfig
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..llm import LLM
from ..ports import free_port
from ..sampling import SamplingParams

if TYPE_CHECKING:
    from pytriton.client import ModelClient

MODEL_NAME = "minillm"
PAD = -1  # fills prompt rows up to `prompt_width` and answer rows up to their longest; never a token id


@dataclass(frozen=True)
class TritonBatching:
    """Triton's dynamic batcher: wait up to `max_queue_delay_ms` for more requests, up to `max_batch_size`
    prompts, sending a batch at once when it reaches one of `preferred_batch_sizes`."""

    max_batch_size: int = 16
    max_queue_delay_ms: float = 10.0
    preferred_batch_sizes: tuple[int, ...] = (4, 8, 16)
    prompt_width: int = 1024  # every prompt row is padded to this many ids


def pad_rows(rows: Sequence[Sequence[int]], width: int | None = None) -> np.ndarray:
    """Token-id rows as one int64 array [len(rows), width], short rows filled with `PAD`."""
    width = max(map(len, rows), default=0) if width is None else width
    if any(len(r) > width for r in rows):
        raise ValueError(f"a row has more than {width} token ids")
    out = np.full((len(rows), width), PAD, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def unpad_row(row: np.ndarray) -> list[int]:
    """One padded row back to its token ids."""
    return [int(t) for t in row if t != PAD]


def _request_work(llm: LLM, req) -> tuple[list[list[int]], list[int]]:
    """One Triton request's prompts and max_tokens, or ValueError naming what the engine cannot run."""
    prompts = [unpad_row(row) for row in req["prompt_ids"]]
    max_tokens = [int(m) for m in req["max_tokens"].reshape(-1)]
    if len(max_tokens) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(max_tokens)} max_tokens")
    for prompt, m in zip(prompts, max_tokens):
        llm.engine.validate(prompt)
        SamplingParams(max_tokens=m)  # checks the value
    return prompts, max_tokens


def make_infer_func(llm: LLM, batch_sizes: Counter[int],
                    ignore_eos: bool = False) -> Callable[[list], list[dict[str, np.ndarray]]]:
    """The function Triton calls with each batch it formed: every prompt of the batch is generated greedily by
    one `LLM.generate` call, so the batch finishes when its longest answer does. A request the engine cannot run
    gets its reason in `error` (and no tokens) while the rest of its batch runs: Triton would fail them all.
    `batch_sizes` counts the batches by their number of requests."""

    def infer(requests: list) -> list[dict[str, np.ndarray]]:
        batch_sizes[len(requests)] += 1
        work, errors = [], []
        for req in requests:
            try:
                work.append(_request_work(llm, req))
                errors.append("")
            except ValueError as e:
                work.append(([], []))
                errors.append(str(e))
        params = [SamplingParams(max_tokens=m, ignore_eos=ignore_eos) for _, ms in work for m in ms]
        outs = iter(llm.generate([p for ps, _ in work for p in ps], params, use_tqdm=False))
        answers = [pad_rows([list(next(outs).outputs[0].token_ids) for _ in ps]) for ps, _ in work]
        return [{"token_ids": a if err == "" else np.full((len(req["prompt_ids"]), 1), PAD, dtype=np.int64),
                 "error": np.array([[err.encode()]] * len(req["prompt_ids"]), dtype=object)}
                for req, a, err in zip(requests, answers, errors)]

    return infer


def _use_this_libpython() -> None:
    """Make Triton's Python backend stub load this interpreter's libpython, not the system's: a stub built for
    3.11 links `libpython3.11.so` by name, and a system 3.11.2 library under a 3.11.7 standard library fails
    with "'_thread.RLock' object has no attribute '_recursion_count'"."""
    libdir = sysconfig.get_config_var("LIBDIR")
    paths = os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep)
    if libdir and libdir not in paths:
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join([libdir, *filter(None, paths)])


@dataclass(frozen=True)
class TritonEndpoint:
    """A running server: its HTTP URL (for `triton_client`) and the batches its dynamic batcher formed."""

    url: str
    batch_sizes: Counter[int]  # requests in a batch -> how many such batches the engine ran


@contextmanager
def serve_triton(llm: LLM, batching: TritonBatching = TritonBatching(), ignore_eos: bool = False,
                 log_file: Path | None = None) -> Iterator[TritonEndpoint]:
    """Run Triton on 127.0.0.1 with `llm` bound as model `MODEL_NAME` (its log on stdout, or in `log_file`), and
    stop the server (and its backend processes) on leaving."""
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig

    _use_this_libpython()
    http_port = free_port()
    config = TritonConfig(http_address="127.0.0.1", http_port=http_port, grpc_address="127.0.0.1",
                          grpc_port=free_port(), allow_metrics=False, exit_timeout_secs=5, log_file=log_file)
    batcher = DynamicBatcher(max_queue_delay_microseconds=int(batching.max_queue_delay_ms * 1000),
                             preferred_batch_size=list(batching.preferred_batch_sizes))
    batch_sizes: Counter[int] = Counter()
    with Triton(config=config) as triton:
        triton.bind(model_name=MODEL_NAME, infer_func=make_infer_func(llm, batch_sizes, ignore_eos),
                    inputs=[Tensor(name="prompt_ids", dtype=np.int64, shape=(batching.prompt_width,)),
                            Tensor(name="max_tokens", dtype=np.int64, shape=(1,))],
                    outputs=[Tensor(name="token_ids", dtype=np.int64, shape=(-1,)),
                             Tensor(name="error", dtype=np.bytes_, shape=(1,))],
                    config=ModelConfig(max_batch_size=batching.max_batch_size, batcher=batcher), strict=True)
        triton.run()
        yield TritonEndpoint(f"http://127.0.0.1:{http_port}", batch_sizes)


def triton_client(url: str, timeout_s: float = 300.0) -> ModelClient:
    """A PyTriton client of the model `serve_triton` binds (a context manager; one per thread)."""
    from pytriton.client import ModelClient

    return ModelClient(url, MODEL_NAME, init_timeout_s=timeout_s, inference_timeout_s=timeout_s)


def triton_generate(client: ModelClient, prompt: Sequence[int], max_tokens: int,
                    prompt_width: int = TritonBatching.prompt_width) -> list[int]:
    """One prompt through `client` (`triton_client`): its greedy answer's token ids, or ValueError with the
    server's reason for refusing it."""
    out = client.infer_sample(prompt_ids=pad_rows([prompt], prompt_width)[0],
                              max_tokens=np.array([max_tokens], dtype=np.int64))
    if error := out["error"][0].decode():
        raise ValueError(error)
    return unpad_row(out["token_ids"])
