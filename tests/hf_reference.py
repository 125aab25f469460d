"""The reference: Hugging Face transformers' own model, greedy, with its own KV cache."""

from __future__ import annotations

import torch


def load_hf(path, device="cpu", dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation (EOS not special) and the logits after the prompt."""
    device = next(model.parameters()).device
    out = model(torch.tensor([prompt_ids], device=device), use_cache=True)
    first_logits = out.logits[0, -1].float().cpu()
    tokens, logits, past = [], out.logits[0, -1], out.past_key_values
    for _ in range(max_new_tokens):
        token = int(logits.argmax())
        tokens.append(token)
        out = model(torch.tensor([[token]], device=device), past_key_values=past, use_cache=True)
        logits, past = out.logits[0, -1], out.past_key_values
    return tokens, first_logits
