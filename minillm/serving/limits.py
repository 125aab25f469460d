"""Chapter 8 — what one request may ask of the server, checked on the parsed body before any heavy work.

A body that passes pydantic can still ask for a day of work: 10,000 prompts, a megabyte of text to tokenize,
hundreds of completions or stop strings. Each limit here is a server flag; a request over one gets a 400
that names the field, the limit and the flag, so a client can tell a limit from a bug.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from ..sampling import MAX_LOGPROBS, MAX_N
from .protocol import ChatCompletionRequest, CompletionRequest, OpenAIError, SamplingRequest


def _limit(default: int | None, help: str):
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ServerLimits:
    """Per-request limits (`--max-...` flags of `python -m minillm serve`); None means the model's context."""

    max_prompts_per_request: int = _limit(64, "prompts in one /v1/completions request")
    max_prompt_chars: int = _limit(1 << 18, "characters of a prompt (of all a chat's messages), before tokenizing")
    max_prompt_tokens: int | None = _limit(None, "tokens of a prompt (default: the model's context)")
    max_n: int = _limit(16, f"completions per prompt, n (at most {MAX_N})")
    max_logprobs: int = _limit(MAX_LOGPROBS, f"logprobs, top_logprobs and prompt_logprobs (at most {MAX_LOGPROBS})")
    max_stops: int = _limit(16, "stop strings, stop token ids, and bad words, per request")
    max_stop_chars: int = _limit(256, "characters of one stop string or bad word")
    max_completion_tokens: int | None = _limit(None, "max_tokens of a request (default: up to the model's context)")
    max_messages: int = _limit(256, "messages in one chat request")
    max_tokenizer_jobs: int = _limit(256, "jobs waiting or running in the tokenizer pool, all routes together; "
                                         "a request beyond them is refused with a 429 before it is tokenized")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{f.name} must be an integer >= 1, got {value!r}")
        if self.max_n > MAX_N or self.max_logprobs > MAX_LOGPROBS:
            raise ValueError(f"max_n is at most {MAX_N} and max_logprobs at most {MAX_LOGPROBS} (the engine's bounds)")

    @staticmethod
    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("limits", "what one request may ask for (each refused with a 400), "
                                                    "and how much tokenizing may wait (a 429 beyond)")
        for f in dataclasses.fields(cls):
            group.add_argument(cls.flag(f.name), dest=f.name, type=int, default=f.default,
                               help=f.metadata["help"] + (f" (default: {f.default})" if f.default else ""))

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerLimits:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def over(self, param: str, what: str, value: int, name: str) -> None:
        """A 400 if `value` exceeds the limit `name` (unset limits pass)."""
        limit = getattr(self, name)
        if limit is not None and value > limit:
            raise OpenAIError(f"{param}: {value} {what}, over this server's limit of {limit} ({self.flag(name)})",
                              param=param, code="limit_exceeded")

    # --- per request --------------------------------------------------------------------------------------

    def check_completion(self, req: CompletionRequest, max_waiting: int | None) -> None:
        prompts = req.prompts()
        self.over("prompt", "prompts in one request", len(prompts), "max_prompts_per_request")
        for p in prompts:  # tokens are counted after truncate_prompt_tokens (`Served.check_prompt`)
            if isinstance(p, str):
                self.over("prompt", "characters", len(p), "max_prompt_chars")
        if req.logprobs is not None:
            self.over("logprobs", "log-probs per token", req.logprobs, "max_logprobs")
        self._check_sampling(req, req.max_tokens, "max_tokens", len(prompts), max_waiting)

    def check_chat(self, req: ChatCompletionRequest, max_waiting: int | None) -> None:
        self.check_messages(req.messages)
        if req.top_logprobs is not None:
            self.over("top_logprobs", "log-probs per token", req.top_logprobs, "max_logprobs")
        if req.max_completion_tokens is not None:
            self._check_sampling(req, req.max_completion_tokens, "max_completion_tokens", 1, max_waiting)
        else:
            self._check_sampling(req, req.max_tokens, "max_tokens", 1, max_waiting)

    def check_messages(self, messages) -> None:
        self.over("messages", "messages", len(messages), "max_messages")
        self.over("messages", "characters", sum(len(m.text(i)) for i, m in enumerate(messages)), "max_prompt_chars")

    def check_prompt_tokens(self, num_tokens: int, param: str) -> None:
        self.over(param, "tokens", num_tokens, "max_prompt_tokens")

    def _check_sampling(self, req: SamplingRequest, max_tokens: int | None, max_tokens_param: str, num_prompts: int,
                        max_waiting: int | None) -> None:
        self.over("n", "completions per prompt", req.n, "max_n")
        if req.prompt_logprobs is not None:
            self.over("prompt_logprobs", "log-probs per prompt token", req.prompt_logprobs, "max_logprobs")
        stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
        self.over("stop", "stop strings", len(stops), "max_stops")
        for s in stops:
            self.over("stop", "characters in one stop string", len(s), "max_stop_chars")
        self.over("stop_token_ids", "stop token ids", len(req.stop_token_ids or []), "max_stops")
        self.over("bad_words", "bad words", len(req.bad_words or []), "max_stops")
        for w in req.bad_words or []:
            self.over("bad_words", "characters in one bad word", len(w), "max_stop_chars")
        if max_tokens is not None and max_tokens_param in req.model_fields_set:  # a default is capped instead
            self.over(max_tokens_param, "tokens", max_tokens, "max_completion_tokens")
        seqs = num_prompts * req.n
        if max_waiting is not None and seqs > max_waiting:
            raise OpenAIError(f"{'n' if num_prompts == 1 else 'prompt'}: {num_prompts} prompt(s) x n = {req.n} are "
                              f"{seqs} sequences, more than may ever wait at once ({max_waiting}, "
                              "--max-waiting-requests): this request could never be admitted",
                              param="n" if num_prompts == 1 else "prompt", code="limit_exceeded")
