"""GGUF blocks decoded by hand: known values from hand-packed bytes, agreement with the `gguf` package's own
dequantize on random blocks and on the default model's tensors, and Q4_1 mapped exactly onto minillm's int4."""

import struct

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from conftest import requires_default_model
from minillm import gguf_blocks
from minillm.quant_formats import dequantize_int4


def q4_1_block(d: float, m: float, q: list[int]) -> bytes:
    """One Q4_1 block: fp16 d, fp16 m, then byte j = q[j] | q[j + 16] << 4."""
    return struct.pack("<ee", d, m) + bytes(q[j] | q[j + 16] << 4 for j in range(16))


def q8_0_block(d: float, q: list[int]) -> bytes:
    return struct.pack("<e32b", d, *q)


def random_blocks(n: int, block_bytes: int, seed: int) -> np.ndarray:
    """n random blocks whose leading fp16 numbers (d, and m for Q4_1) are finite: random bytes could be NaN."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, block_bytes), dtype=np.uint8)
    halves = 2 if block_bytes == gguf_blocks.Q4_1_BYTES else 1
    blocks[:, : 2 * halves] = (rng.standard_normal((n, halves)) * 0.02).astype(np.float16).view(np.uint8)
    return blocks.reshape(-1)


def test_q4_1_hand_built_block():
    q = list(range(16)) + [15 - i for i in range(16)]
    got = gguf_blocks.decode_q4_1(q4_1_block(0.5, -2.0, q))
    assert got.dtype == torch.float32 and got.shape == (32,)
    assert got.tolist() == [0.5 * v - 2.0 for v in q]


def test_q4_1_nibble_layout():
    """Byte j holds weight j in its low nibble and weight j + 16 in its high one."""
    raw = struct.pack("<ee", 1.0, 0.0) + bytes([0x21] + [0] * 15)
    got = gguf_blocks.decode_q4_1(raw).tolist()
    assert got[0] == 1 and got[16] == 2 and sum(got) == 3


def test_q8_0_hand_built_blocks():
    q1, q2 = list(range(-16, 16)), [-128, 127] * 16
    got = gguf_blocks.decode_q8_0(q8_0_block(0.25, q1) + q8_0_block(-2.0, q2))
    assert got.dtype == torch.float32 and got.shape == (64,)
    assert got.tolist() == [0.25 * v for v in q1] + [-2.0 * v for v in q2]


@pytest.mark.parametrize("n", [1, 7, 100])
def test_random_blocks_match_gguf(n):
    for decode, qtype, size in [(gguf_blocks.decode_q4_1, GGMLQuantizationType.Q4_1, gguf_blocks.Q4_1_BYTES),
                                (gguf_blocks.decode_q8_0, GGMLQuantizationType.Q8_0, gguf_blocks.Q8_0_BYTES)]:
        raw = random_blocks(n, size, seed=n)
        want = torch.from_numpy(dequantize(raw, qtype).reshape(-1))
        for form in (raw, raw.tobytes(), torch.from_numpy(raw.copy())):
            assert torch.equal(decode(form), want), f"{qtype.name}, {n} blocks, given as {type(form).__name__}"


def test_q4_1_maps_exactly_onto_int4():
    raw = random_blocks(48 * 6, gguf_blocks.Q4_1_BYTES, seed=3)  # a [48, 192] matrix: 6 blocks a row
    q, scale, zero = gguf_blocks.q4_1_to_int4(raw, (48, 192))
    assert q.dtype == torch.uint8 and q.shape == (48, 192) and int(q.max()) <= 15
    assert scale.shape == zero.shape == (48, 6) and scale.dtype == zero.dtype == torch.float32
    assert torch.equal(dequantize_int4(q, scale, zero), gguf_blocks.decode_q4_1(raw).view(48, 192))


def test_bits_per_weight():
    assert gguf_blocks.bits_per_weight("Q4_0") == 4.5
    assert gguf_blocks.bits_per_weight("Q4_1") == 5.0
    assert gguf_blocks.bits_per_weight("q8_0") == 8.5
    assert gguf_blocks.bits_per_weight("F16") == 16
    with pytest.raises(ValueError, match="Q9_9"):
        gguf_blocks.bits_per_weight("Q9_9")


def test_errors():
    with pytest.raises(ValueError, match="41 bytes"):
        gguf_blocks.decode_q4_1(bytes(41))
    with pytest.raises(ValueError, match="33 bytes"):
        gguf_blocks.decode_q8_0(bytes(33))
    with pytest.raises(ValueError, match="uint8"):
        gguf_blocks.decode_q4_1(np.zeros(20, dtype=np.int8))
    with pytest.raises(ValueError, match="uint8"):
        gguf_blocks.decode_q8_0(torch.zeros(34))
    with pytest.raises(ValueError, match="blocks"):
        gguf_blocks.q4_1_to_int4(bytes(20 * 4), (2, 96))  # 2 rows of 3 blocks need 6
    with pytest.raises(ValueError, match="48 inputs"):
        gguf_blocks.q4_1_to_int4(bytes(20 * 3), (2, 48))


@pytest.mark.slow
@requires_default_model
def test_default_gguf_tensors_match_gguf():
    from gguf import GGUFReader

    from minillm.weights import default_gguf_path

    tensors = GGUFReader(default_gguf_path()).tensors
    first_q4_1 = next(t.name for t in tensors if t.tensor_type == GGMLQuantizationType.Q4_1)
    read = {name: gguf_blocks.read_tensor(name) for name in (first_q4_1, "token_embd.weight")}
    assert read["token_embd.weight"][1:] == ("Q8_0", (49152, 576))
    for name, (raw, qtype, shape) in read.items():
        decode = {"Q4_1": gguf_blocks.decode_q4_1, "Q8_0": gguf_blocks.decode_q8_0}[qtype]
        assert raw.dtype == np.uint8 and raw.size * 8 == gguf_blocks.bits_per_weight(qtype) * np.prod(shape)
        want = dequantize(raw, GGMLQuantizationType[qtype]).reshape(shape)
        assert torch.equal(decode(raw).view(shape), torch.from_numpy(want)), name
        if qtype == "Q4_1":
            assert torch.equal(dequantize_int4(*gguf_blocks.q4_1_to_int4(raw, shape)), torch.from_numpy(want))
    with pytest.raises(ValueError, match="no tensor"):
        gguf_blocks.read_tensor("no.such.weight")
