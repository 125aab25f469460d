"""Chapter 8 — beam search on top of the engine, as vLLM's `LLM.beam_search` does it.

Each step asks the engine for one more token of every live beam, with the log-probs of its 2 x width most
likely next tokens; every beam grows by each of those, and the `width` best new beams (by cumulative
log-prob) live on. A beam that picks EOS is complete. Every step re-submits each beam as a new prompt,
so the prefix cache is what keeps this affordable: only the beam's last, partly filled block is
recomputed. The price against greedy decoding is that recomputation, `width` times the KV cache, and
more decode steps per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .sampling import SamplingParams


@dataclass
class BeamSearchParams:
    """Beams to keep, tokens to generate, and the length penalty of the final ranking (vLLM's names)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if 2 * self.beam_width > 20:
            raise ValueError(f"beam_width must be <= 10 (2 x width log-probs per step), got {self.beam_width}")


@dataclass
class BeamSearchSequence:
    """One beam: its generated tokens and their summed log-probability (and the text, once finished)."""

    tokens: list[int]
    cum_logprob: float = 0.0
    finished: bool = False  # ended with EOS
    text: str = ""

    def score(self, length_penalty: float) -> float:
        """cum_logprob / length ** penalty: with penalty 1, the mean log-prob per token (EOS not counted)."""
        length = max(1, len(self.tokens) - self.finished)
        return self.cum_logprob / length ** length_penalty


@dataclass
class BeamSearchOutput:
    """The best `beam_width` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


def beam_search(llm, prompts: list[str | list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Beam search for each prompt (text or token ids); the engine runs all beams of all prompts together."""
    engine = llm.engine
    prompt_ids = [engine.tokenize(p)[1] for p in prompts]
    beams = [[BeamSearchSequence([])] for _ in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    step = SamplingParams(max_tokens=1, logprobs=2 * params.beam_width, ignore_eos=True)
    for _ in range(params.max_tokens):
        live = [(i, b) for i, bs in enumerate(beams) for b in bs]
        if not live:
            break
        outs = llm.generate([prompt_ids[i] + b.tokens for i, b in live], step, use_tqdm=False)
        grown: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        for (i, beam), out in zip(live, outs):
            for token, lp in out.outputs[0].logprobs[0].items():
                child = BeamSearchSequence(beam.tokens + [token], beam.cum_logprob + lp.logprob)
                if token in engine.eos_token_ids and not params.ignore_eos:
                    child.finished = True
                    done[i].append(child)
                else:
                    grown[i].append(child)
        beams = [sorted(g, key=lambda b: b.cum_logprob, reverse=True)[:params.beam_width] for g in grown]
    results = []
    for finished, live in zip(done, beams):
        best = sorted(finished + live, key=lambda b: b.score(params.length_penalty), reverse=True)
        for b in best[:params.beam_width]:
            b.text = engine.tokenizer.decode(b.tokens, skip_special_tokens=True)
        results.append(BeamSearchOutput(best[:params.beam_width]))
    return results
