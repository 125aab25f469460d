"""Chapter 2's float32 products: which kernel a layer runs is chosen by timing both on this CPU, and whichever it
is, a layer computes exactly what that kernel computes (F.linear below the chosen row count, oneDNN's packed
product from it on)."""

import pytest
import torch
import torch.nn.functional as F

from minillm.layers import PROBE_ROWS, Linear, packed_linear, packed_min_rows, use_packed_weights

pytestmark = pytest.mark.skipif(not use_packed_weights("cpu", torch.float32), reason="needs oneDNN on a CPU")


def test_the_choice_is_a_probe_boundary_and_stays_the_same_in_a_process():
    n = packed_min_rows(96, 64, torch.get_num_threads())
    assert n == 1 or n - 1 in PROBE_ROWS
    assert packed_min_rows(96, 64, torch.get_num_threads()) == n  # timed once per process and shape


@pytest.mark.parametrize("min_rows", [1, 5, 1000])
def test_a_layer_runs_the_kernel_chosen_for_its_row_count(min_rows):
    torch.manual_seed(0)
    layer = Linear(64, 96)
    layer.pack(min_rows)
    residual = torch.randn(8, 96)
    with torch.inference_mode():
        for rows in (1, 4, 5, 8):
            x = torch.randn(rows, 64)
            got = layer.forward(x, residual[:rows])
            if rows >= min_rows:
                want = packed_linear(x, layer.packed, layer.bias, residual[:rows])
            else:
                want = F.linear(x, layer.weight, layer.bias) + residual[:rows]
            assert torch.equal(got, want), rows
    layer.pack()  # a repack (after the weight changed) keeps the row count
    assert layer.packed_min_rows == min_rows


def test_the_model_applies_one_choice_to_every_layer_and_the_tied_head(tiny_llama):
    from minillm import LLM

    model = LLM(tiny_llama, device="cpu", dtype=torch.float32).engine.model
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert {m.packed_min_rows for m in layers} == {model.packed_min_rows}
    assert all(m.packed is not None for m in layers)
