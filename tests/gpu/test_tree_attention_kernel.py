"""The Triton tree-attention kernel compiled on CUDA against the dense reference."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from tree_attention_check import max_error, random_case

from vllm_dominotree.kernels.tree_attention import TreeAttention, tree_attention_reference

# (heads, KV heads, head dim): Qwen3-4B's, and SmolLM2-135M's (a group of 3, padded to 4
# in the kernel's query tile; 4 warps where Qwen's takes 8).
SHAPES = {"qwen3-4b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}
# float32 inputs multiply at Triton's default precision, TF32 (10-bit mantissa), as vLLM's
# Triton attention does: errors against the IEEE reference reach 2.6e-3 on the H200
# (2026-12-03); a wrong mask, split or merge gives errors of order 0.1 and more.
FLOAT32_TOLERANCE = 5e-3


@pytest.mark.parametrize("seed", range(4))
# key splits + merge / one split / one split in vLLM's Triton tiles
@pytest.mark.parametrize("capacity, like_triton", [(4096, False), (8, False), (4096, True)])
@pytest.mark.parametrize(
    "dtype, tolerance", [(torch.float32, FLOAT32_TOLERANCE), (torch.bfloat16, 3e-2)]
)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernel_matches_dense_reference(seed, capacity, like_triton, dtype, tolerance, shape):
    heads, kv_heads, head_dim = SHAPES[shape]
    error, other, fixed = max_error(
        "cuda",
        dtype,
        seed,
        capacity,
        like_triton,
        head_dim=head_dim,
        kv_heads=kv_heads,
        heads=heads,
    )
    print(f"{shape} {dtype} capacity {capacity} {like_triton=} seed {seed}: error {error:.2e}")
    assert fixed > 0
    assert error < tolerance
    assert other == 0


@pytest.mark.parametrize("shape", list(SHAPES))
def test_one_kernel_over_successive_layers(shape):
    """As in a forward: one kernel (its partial buffers and split counters) launched for
    layer after layer with different caches and queries, each launch right for its own
    (a merge that read an earlier launch's partials would fail here, not in a test that
    launches the same case twice)."""
    heads, kv_heads, head_dim = SHAPES[shape]
    kernel = TreeAttention(heads, head_dim, 17, torch.device("cuda"))
    for layer in range(6):
        args = random_case(
            "cuda", torch.float32, 100 + layer, heads=heads, kv_heads=kv_heads, head_dim=head_dim
        )
        query, needs_fix = args[0], args[-1]
        scale = head_dim**-0.5
        got, want = torch.zeros_like(query), torch.zeros_like(query)
        kernel(*args, scale, got)
        tree_attention_reference(*args, scale, want)
        fixed = needs_fix.bool()
        assert fixed.any(), layer  # (these seeds draw branching trees)
        error = (got[fixed] - want[fixed]).abs().max().item()
        print(f"{shape} layer {layer}: max error {error:.2e} over {int(fixed.sum())} rows")
        assert error < FLOAT32_TOLERANCE, layer
    assert not kernel.counters.any()
