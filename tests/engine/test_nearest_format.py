"""A GGUF file's block types the kernels do not read load in the nearest format they do
(engine/files/nearest_format.py): q8_0, within a q8_0 step of llama.cpp's dequantized weights; the
types they read (the K-quants among them) load as stored. The blocks are random bytes (any bytes
are valid blocks) with finite f16 scales."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine.files.nearest_format import convert, served, served_bytes
from engine.ops import blocks
from tests.engine.block_samples import Q, random_blocks

ROWS, COLS = 6, 512


@pytest.mark.parametrize("kind", [Q.Q2_K, Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS])
def test_other_types_load_as_q8_0_within_a_step(kind):
    data = random_blocks(kind, ROWS, COLS)
    reference = torch.from_numpy(gguf.quants.dequantize(data, kind)).reshape(ROWS, COLS)
    got = blocks.dequantize(convert(data, kind, ROWS, COLS), "q8_0", COLS)
    step = reference.view(ROWS, -1, 32).abs().amax(-1, keepdim=True) / 127
    # Half a step of rounding, and the f16 rounding of the step itself (2^-11) over up to 127 steps.
    assert ((got - reference).view(ROWS, -1, 32).abs() <= step * (0.5 + 127 * 2 ** -11) * 1.001).all()
    assert not np.array_equal(got.numpy(), np.zeros_like(got.numpy()))


def test_served_formats_and_their_bytes():
    kinds = (Q.Q4_0, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q3_K, Q.IQ2_XXS, Q.F16)
    assert [served(k, (8, 256)) for k in kinds] == ["q4_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "q8_0", "q8_0", None]
    assert served(Q.Q5_0, (8, 48)) is None and served(Q.Q4_K, (256,)) is None  # not whole blocks; a vector
    assert served_bytes(Q.Q4_K, (8, 256), 8 * 144) == 8 * 144  # as stored
    assert served_bytes(Q.Q3_K, (8, 256), 8 * 110) == 8 * 8 * 34  # as q8_0
