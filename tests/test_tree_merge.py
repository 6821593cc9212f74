"""The merged tree attention (one-pass-merge, kernels/tree_merge.py) under Triton's
interpreter: every row of random trees over random paged prefixes, FA3's prefix pass
played by the dense stand-in, against the dense ancestor-only reference."""

from __future__ import annotations

import pytest
from interpreter import run_interpreted

CASES = {
    # (heads, KV heads, head dim, contexts or None): Qwen3-4B's heads; SmolLM2-135M's (a
    # GQA group of 3, padded to 4); an empty prefix (a graph's padding request: FA's
    # +inf log-sum-exp must weigh nothing) beside a long one.
    "qwen3-4b": (32, 8, 128, None),
    "smollm2": (9, 3, 64, None),
    "empty-prefix": (4, 2, 32, [0, 40, 0, 300]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_merged_rows_equal_the_reference(case):
    heads, kv_heads, head_dim, contexts = CASES[case]
    out = run_interpreted(f"""
import torch
from path_checks import merged_case, reference
from tree_attention_check import random_case

for seed in (0, 1):
    case = random_case("cpu", torch.float32, seed, requests=4, heads={heads},
                       kv_heads={kv_heads}, head_dim={head_dim}, max_context=200,
                       contexts={contexts!r})
    got, want = merged_case(case), reference(case, every_row=True)
    error = (got - want).abs().max().item()
    rows = case[0].shape[0]
    print("seed", seed, "rows", rows, "error", error)
    assert error < 2e-5, error
print("ok")
""")
    assert "rows" in out


def test_a_wrong_ancestor_bit_is_seen():
    """The check can fail: the same case with one row's ancestor bits cleared gives
    that row another output."""
    run_interpreted("""
import torch
from path_checks import merged_case, reference
from tree_attention_check import random_case

case = random_case("cpu", torch.float32, 3, requests=3, heads=4, kv_heads=2, head_dim=32,
                   max_context=50)
ancestors = case[6]
row = int(torch.nonzero(ancestors).flatten()[-1])
broken = list(case)
broken[6] = ancestors.clone()
broken[6][row] = 0
got, want = merged_case(tuple(broken)), reference(case, every_row=True)
assert (got[row] - want[row]).abs().max() > 1e-3
others = torch.arange(got.shape[0]) != row
assert (got[others] - want[others]).abs().max() < 2e-5
print("ok")
""")


def test_a_shape_the_kernel_cannot_take_is_named():
    from vllm_dominotree.kernels.tree_merge import check_merge_shape

    check_merge_shape(32, 8, 128)
    check_merge_shape(9, 3, 64)
    for shape in ((32, 8, 96), (10, 4, 64)):
        with pytest.raises(ValueError, match="DOMINOTREE_CUDA_TREE_ATTENTION=one-pass"):
            check_merge_shape(*shape)
