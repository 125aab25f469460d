"""The scaling benchmark's random-weight GGUF files: what `benchmarks/random_gguf.py` writes in llama.cpp's layout
and reads back for minillm equals what transformers' own GGUF reader makes of the same file (which undoes
llama.cpp's query/key order its own way), for a Llama and a Qwen2 shape, and the parameter count is the model's."""

import pytest
import torch
from safetensors.torch import load_file

from benchmarks.random_gguf import gguf_to_hf, make_shape, permute_rows, unpermute_rows, write_gguf

SHAPES = [make_shape("tiny-llama", "llama", 49152, 64, 96, 2, 4, 2, 16, 10000.0, 1e-5),
          make_shape("tiny-qwen2", "qwen2", 49200, 64, 96, 2, 4, 1, 32, 1000000.0, 1e-6)]  # a padded vocabulary


def test_permute_rows_is_undone_exactly():
    w = torch.randn(4 * 16, 8)
    assert torch.equal(unpermute_rows(torch.from_numpy(permute_rows(w.numpy(), 4)), 4), w)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_weights_read_back_equal_transformers_reading_of_the_same_file(shape, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    write_gguf(shape, tmp_path / "m.gguf", seed=1)
    gguf_to_hf(tmp_path / "m.gguf", shape, tmp_path / "hf")
    ours = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        ours.update(load_file(str(f)))
    config = AutoConfig.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    theirs = load_gguf_checkpoint(str(tmp_path / "m.gguf"), return_tensors=True, model_to_load=skeleton)["tensors"]
    theirs.pop("lm_head.weight", None)  # the tied head: the embedding again
    assert set(ours) == set(theirs)
    for name, w in ours.items():
        assert torch.equal(w, torch.as_tensor(theirs[name]).float()), name
    assert sum(w.numel() for w in ours.values()) == shape.num_params
    assert AutoConfig.from_pretrained(str(tmp_path / "hf")).vocab_size == shape.config.vocab_size


def test_minillm_runs_the_decoded_directory_and_padded_tokens_have_no_text(tmp_path):
    from minillm import LLM, SamplingParams

    shape = SHAPES[1]  # 48 rows past the tokenizer's vocabulary
    write_gguf(shape, tmp_path / "m.gguf")
    gguf_to_hf(tmp_path / "m.gguf", shape, tmp_path / "hf")
    llm = LLM(str(tmp_path / "hf"), device="cpu", enable_prefix_caching=False)
    padded = shape.config.vocab_size - 1
    params = SamplingParams(max_tokens=2, logprobs=3, allowed_token_ids=[padded, 100])
    out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
    assert padded in out.logprobs[0] and out.logprobs[0][padded].decoded_token == ""
    assert set(out.token_ids) <= {padded, 100}
