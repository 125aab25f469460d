"""Chapter 8 — from new tokens to what a caller sees: incremental text, stop rules, log-probs and RequestOutputs.

The engine step computes tokens; this module decides when a completion is done (EOS, a stop token or
stop string, max_tokens, the end of the context) and what each output carries: everything so far, only
what is new (for streaming), or one output at the end (vLLM's `RequestOutputKind`). It plays the part of
the OutputProcessor in vLLM's frontend. A request with n > 1 has one completion per sequence and one
output that gathers them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .detokenizer import detokenize_incrementally
from .metrics import RequestMetrics
from .outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from .sampling import RequestOutputKind, SamplingParams, TokenLogprobs
from .sequence import Sequence
from .stop_strings import StopStringFilter, compile_stops


@dataclass(eq=False)
class CompletionState:
    """One completion's text and log-probs as released so far, and how much of it earlier outputs carried."""

    seq: Sequence
    request: RequestState
    stop: StopStringFilter
    text: str = ""  # released text (held-back stop-string prefixes are not in it)
    prefix_offset: int = 0  # detokenizer window over the output tokens (see detokenizer.py)
    read_offset: int = 0
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    sent_tokens: int = 0  # tokens, log-prob entries and characters already given out (DELTA outputs)
    sent_text: int = 0
    sent_finish: bool = False


@dataclass(eq=False)
class RequestState:
    """A request as its caller sees it: prompt, parameters, timing, and its n completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    completions: list[CompletionState] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    sent_prompt_logprobs: bool = False

    @property
    def seqs(self) -> list[Sequence]:
        return [c.seq for c in self.completions]

    @property
    def finished(self) -> bool:
        return all(c.seq.is_finished for c in self.completions)


class OutputProcessor:
    """Holds the tokenizer and the stop rules; turns engine results into RequestOutputs."""

    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer, self.eos_token_ids, self.max_model_len = tokenizer, eos_token_ids, max_model_len
        self._token_text: dict[int, str] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, metrics: RequestMetrics, seqs: list[Sequence]) -> RequestState:
        """Track a new request's completions; its n completions share one automaton of its stop strings
        (`compile_stops`: built here unless the caller had it built ahead)."""
        state = RequestState(request_id, prompt, prompt_token_ids, params, metrics,
                             prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        stops = compile_stops(tuple(params.stop))
        for seq in seqs:
            completion = CompletionState(seq, state, StopStringFilter(stops))
            if params.logprobs is not None:
                completion.logprobs, completion.cumulative_logprob = [], 0.0
            seq.completion = completion
            state.completions.append(completion)
        return state

    def token_text(self, token_id: int) -> str:
        """One token shown on its own (as in log-probs): a byte-level piece may be an unfinished character. A row
        of the model's vocabulary past the tokenizer's (padding, as in Qwen2.5's) has no text."""
        text = self._token_text.get(token_id)
        if text is None:
            tokens = [t for t in self.tokenizer.convert_ids_to_tokens([token_id]) if t is not None]
            text = self._token_text[token_id] = self.tokenizer.convert_tokens_to_string(tokens) if tokens else ""
        return text

    def position(self, lp: TokenLogprobs) -> PositionLogprobs:
        """The entry for one position: the token that came next first, then the top alternatives."""
        entry = {lp.token_id: Logprob(lp.logprob, lp.rank, self.token_text(lp.token_id))}
        for rank, (token_id, logprob) in enumerate(zip(lp.top_ids, lp.top_logprobs), start=1):
            entry.setdefault(token_id, Logprob(logprob, rank, self.token_text(token_id)))
        return entry

    def add_prompt_logprobs(self, seq: Sequence, scored: list[TokenLogprobs]) -> None:
        seq.completion.request.prompt_logprobs += [self.position(lp) for lp in scored]

    def on_token(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> str | None:
        """Take the sequence's newest token: extend its text and say why it is done ("stop", "length"), or None.

        As in vLLM, the text of a token that stops the completion (EOS, stop_token_ids) is left out unless
        include_stop_str_in_output, and stop strings count only from the token after the first min_tokens.
        """
        c, params = seq.completion, seq.params
        if logprobs is not None:
            c.logprobs.append(self.position(logprobs))
            c.cumulative_logprob += logprobs.logprob
        reason = None
        # a grammar (structured output) allows EOS only where its output is complete: then it ends, ignore_eos or not
        if token in self.eos_token_ids and (not params.ignore_eos or seq.grammar is not None):
            reason = "stop"
        elif token in seq.stop_token_ids:  # one of params.stop_token_ids (EOS was the case above)
            reason, c.stop_reason = "stop", token
        elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        shown = seq.output_token_ids
        if reason == "stop" and not params.include_stop_str_in_output:
            shown = shown[:-1]
        # at the end, a character cut off mid-way is shown (U+FFFD), as a full decode would show it
        delta, c.prefix_offset, c.read_offset = detokenize_incrementally(
            self.tokenizer, shown, c.prefix_offset, c.read_offset, final=reason is not None,
            skip_special_tokens=params.skip_special_tokens)
        c.text += c.stop.push(delta, match=len(seq.output_token_ids) > params.min_tokens)
        if c.stop.matched is not None:  # a stop string came before any stop token
            c.stop_reason = c.stop.matched
            if params.include_stop_str_in_output:
                c.text += c.stop.matched
            return "stop"
        if reason is not None:
            c.text += c.stop.flush()
        return reason

    def on_abort(self, seq: Sequence) -> None:
        """A completion cut short (aborted, or ended by an error) keeps what it generated: held-back text is
        released."""
        seq.completion.text += seq.completion.stop.flush()

    def output(self, state: RequestState) -> RequestOutput | None:
        """The request's output after a step, shaped by its output kind (None: nothing to report now)."""
        kind = state.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not state.finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        outputs = [o for c in state.completions if (o := self._completion(c, delta)) is not None]
        if not outputs:
            return None
        prompt_logprobs = None if delta and state.sent_prompt_logprobs else state.prompt_logprobs
        state.sent_prompt_logprobs = True
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, outputs, state.finished,
                             state.metrics, prompt_logprobs)

    @staticmethod
    def _completion(c: CompletionState, delta: bool) -> CompletionOutput | None:
        seq, stop_reason = c.seq, c.stop_reason
        if not delta:
            return CompletionOutput(seq.index, c.text, list(seq.output_token_ids), seq.finish_reason, stop_reason,
                                    c.cumulative_logprob, None if c.logprobs is None else list(c.logprobs))
        tokens, text = seq.output_token_ids[c.sent_tokens:], c.text[c.sent_text:]
        if not tokens and not text and (c.sent_finish or not seq.is_finished):
            return None  # nothing new for this completion
        logprobs = None if c.logprobs is None else c.logprobs[c.sent_tokens:]
        c.sent_tokens, c.sent_text, c.sent_finish = len(seq.output_token_ids), len(c.text), seq.is_finished
        return CompletionOutput(seq.index, text, tokens, seq.finish_reason, stop_reason, c.cumulative_logprob, logprobs)
