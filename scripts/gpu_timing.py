"""Print the environment, then time decode of a SmolLM2-135M-shaped model with random weights on this device."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=100000.0,
                    architectures=["LlamaForCausalLM"], model_type="llama", eos_token_id=2)


def environment() -> dict:
    import transformers

    env = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
           "cuda": torch.version.cuda, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def decode_tokens_per_s(llm, batch: int, prompt_len: int = 128, new_tokens: int = 128) -> float:
    """Output tokens/s of `batch` requests decoding together, measured from the engine's own timestamps."""
    from minillm import SamplingParams

    prompts = [[(7 * i + j) % 1000 + 10 for j in range(prompt_len)] for i in range(batch)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)
    start = max(o.metrics.first_token_time for o in outs)
    end = max(o.metrics.finished_time for o in outs)
    return batch * (new_tokens - 1) / (end - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--env-only", action="store_true")
    args = parser.parse_args()
    print(json.dumps(environment(), indent=1))
    if args.env_only:
        return
    from minillm import LLM
    from tiny_models import build_tokenizer

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(SMOLLM2_135M))
        build_tokenizer(Path(d))
        llm = LLM(d, load_format="dummy", max_num_seqs=64)
        print("stats:", {k: llm.stats()[k] for k in ("device", "dtype", "kv_blocks_total", "max_model_len")})
        from minillm import SamplingParams

        ttft = []  # the engine warmed itself up when built: the first request should be as quick as the next
        for i in range(3):
            out = llm.generate([[11 + i] * 100], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
            ttft.append(round(1e3 * (out.metrics.first_token_time - out.metrics.arrival_time), 1))
        print(f"warm-up when built: {llm.engine.warmup_seconds:.2f} s; TTFT of the first three requests: {ttft} ms")
        decode_tokens_per_s(llm, 1, new_tokens=16)  # warm-up
        for batch in (1, 8, 32, 64):
            runs = [decode_tokens_per_s(llm, batch) for _ in range(3)]
            print(f"decode batch {batch:3d}: {statistics.median(runs):9.1f} output tokens/s (median of 3)")


if __name__ == "__main__":
    main()
