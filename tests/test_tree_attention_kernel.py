"""The Triton kernels, run by Triton's interpreter on the CPU (the same kernels run
compiled on the H200 in tests/gpu): the tree-row fix-up against the dense reference,
and the one-launch K/V move of accepted paths."""

from __future__ import annotations

from interpreter import run_interpreted

ATTENTION = """
import torch
from tree_attention_check import max_error
# capacity 4096: key splits + merge; capacity 8: one split, written directly; like_triton:
# one split in vLLM's Triton tiles.
cases = [(0, 1100, 4096, False), (1, 1100, 8, False), (2, 300, 4096, False), (3, 60, 8, False)]
cases += [(4, 1100, 4096, True), (5, 70, 4096, True)]
for seed, context, capacity, like_triton in cases:
    error, other, fixed = max_error(
        "cpu", torch.float32, seed, capacity, like_triton, max_context=context
    )
    print(seed, context, capacity, like_triton, error, other, fixed)
    assert fixed > 0, seed
    assert error < 1e-4, (seed, error)
    assert other == 0, (seed, other)
print("ok")
"""

MOVE = """
import torch
from vllm_dominotree.kernels.kv_move import PathKVMover
page, blocks = 4, 8
caches = [torch.randn(blocks, 2, page, 16) for _ in range(3)]  # [blocks, kv heads, page, 2D]
before = [c.clone() for c in caches]
# Three requests' rows in the forward, and their slots: request 0 accepts nodes at rows
# 2, 3 (-> rows 1, 2), request 1 accepts row 1 (already in place), request 2 row 3 (-> 1).
slots = torch.tensor([9, 10, 11, 12, 13, 20, 21, 22, 23, 3, 4, 5, 6])
query_start = torch.tensor([0, 5, 9, 13], dtype=torch.int32)
paths = torch.tensor([[2, 3, -1, -1], [1, -1, -1, -1], [3, -1, -1, -1]])
PathKVMover(caches)(slots, query_start, paths, torch.tensor([2, 1, 1]))
moves = {10: 11, 11: 12, 4: 6}
for cache, old in zip(caches, before):
    for s in range(blocks * page):
        want = old[moves.get(s, s) // page, :, moves.get(s, s) % page]
        assert torch.equal(cache[s // page, :, s % page], want), s
print("ok")
"""


def test_tree_rows_match_dense_reference_and_other_rows_are_untouched():
    run_interpreted(ATTENTION)


def test_accepted_paths_move_to_the_rows_after_their_roots():
    run_interpreted(MOVE)
