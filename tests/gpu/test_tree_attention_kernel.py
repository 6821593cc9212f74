"""The Triton tree-attention kernel compiled on CUDA against the dense reference."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from tree_attention_check import max_error


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-3), (torch.bfloat16, 3e-2)])
def test_kernel_matches_dense_reference(seed, dtype, tolerance):
    tree, other = max_error("cuda", dtype, seed)
    assert tree < tolerance
    assert other == 0
