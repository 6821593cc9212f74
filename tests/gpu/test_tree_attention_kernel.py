"""The Triton tree-attention kernel compiled on CUDA against the dense reference."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from tree_attention_check import max_error


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("capacity", [4096, 8])  # key splits + merge / one split
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-3), (torch.bfloat16, 3e-2)])
def test_kernel_matches_dense_reference(seed, capacity, dtype, tolerance):
    error, other, fixed = max_error(
        "cuda", dtype, seed, capacity, head_dim=128, kv_heads=8, heads=32
    )
    assert fixed > 0
    assert error < tolerance
    assert other == 0
