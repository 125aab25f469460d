"""Chapter 4 — the offline API: `LLM(...).generate(prompts, SamplingParams(...))`, shaped like vLLM's."""

from __future__ import annotations

from collections.abc import Iterator, Sequence as Seq
from dataclasses import replace
from pathlib import Path

from tqdm.auto import tqdm

from .beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from .engine import LLMEngine
from .engine_args import EngineArgs
from .outputs import RequestOutput
from .sampling import RequestOutputKind, SamplingParams


class LLM:
    """Load a model once, then generate for many prompts; every request runs through `LLMEngine.step`."""

    def __init__(self, model: str | Path | EngineArgs | None = None, **kwargs):
        """`LLM()` for the default model, `LLM(path, quantization="int4", ...)`: any `EngineArgs` field."""
        self.engine = LLMEngine(model, **kwargs)
        self._pending: dict[str, list[RequestOutput]] = {}  # outputs stepped out for another reader
        self._abandoned: set[str] = set()  # aborted by a reader that left; their last output is dropped

    def shutdown(self) -> None:
        """Stop the worker processes of a parallel layout now (they also stop when this object is collected,
        and when this process exits or dies)."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> None:
        """Forget the cached prefixes of finished requests, so the next run computes every prompt again."""
        self.engine.reset_prefix_cache()

    def stats(self) -> dict:
        return self.engine.stats()

    def _add_all(self, prompts, sampling_params, kind: RequestOutputKind | None = None) -> list[str]:
        """Validate every prompt and parameter set first, so a bad one leaves nothing queued."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; pass one or one per prompt")
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}")
            try:
                self.engine.validate(self.engine.tokenize(prompt, p.truncate_prompt_tokens)[1])
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            self.engine.compile_grammar(p)  # cached: adding the request finds it compiled
        if kind is not None:
            params = [replace(p, output_kind=kind) for p in params]
        return [self.engine.add_request(None, prompt, p) for prompt, p in zip(prompts, params)]

    def _outputs(self, ids: list[str]) -> Iterator[RequestOutput]:
        """Step the engine until the requests `ids` finish, yielding their outputs in order.

        Outputs of the engine's other requests (another `stream` still open, say) are kept for their
        readers, never dropped; if the caller stops early, its unfinished requests are aborted.
        """
        live = set(ids)
        try:
            while live:
                mine = [out for rid in ids if rid in live for out in self._pending.pop(rid, ())]
                if not mine:
                    if not self.engine.has_unfinished_requests():
                        raise RuntimeError(f"requests {sorted(live)} are not in the engine")
                    for out in self.engine.step():
                        if out.request_id in live:
                            mine.append(out)
                        elif out.request_id in self._abandoned:
                            if out.finished:
                                self._abandoned.discard(out.request_id)
                        else:
                            self._pending.setdefault(out.request_id, []).append(out)
                for out in mine:
                    if out.finished:
                        live.discard(out.request_id)
                    yield out
        finally:
            for rid in live:
                self._pending.pop(rid, None)
                if self.engine.abort(rid) is None:
                    self._abandoned.add(rid)  # a step elsewhere will return its final output: drop it

    def take_outputs(self, request_id: str) -> list[RequestOutput]:
        """Outputs of a request added through `llm.engine` that this LLM's own steps returned meanwhile."""
        return self._pending.pop(request_id, [])

    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run all prompts to completion (together, as the scheduler sees fit); outputs in prompt order.

        Returns when these requests finish, whatever else the engine is running.
        """
        ids = self._add_all(prompts, sampling_params, RequestOutputKind.FINAL_ONLY)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", disable=not use_tqdm) as bar:
            for out in self._outputs(ids):
                if out.finished:
                    finished[out.request_id] = out
                    bar.update(1)
        return [finished[i] for i in ids]

    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's outputs as they come (cumulative or deltas, as `output_kind` says).

        Closing the generator early aborts the request.
        """
        yield from self._outputs(self._add_all([prompt], sampling_params))

    def beam_search(self, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
        """The `beam_width` most likely continuations of each prompt (see beam_search.py for the cost)."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        return beam_search(self, [prompts] if single else list(prompts), params)

    def apply_chat_template(self, messages) -> list[int]:
        """Token ids of a conversation (list of {"role", "content"} dicts) ready for the assistant's reply."""
        return self.engine.apply_chat_template(messages)

    def chat(self, messages, sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation, or to each of a list of conversations."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        return self.generate([self.apply_chat_template(c) for c in conversations], sampling_params, use_tqdm)
