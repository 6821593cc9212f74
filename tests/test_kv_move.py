"""Moving accepted paths' K/V inside a CUDA-layout cache ([blocks, kv heads, page,
2 * head dim]), as the CUDA backends do after acceptance; checked here on CPU tensors."""

from __future__ import annotations

import torch

from vllm_dominotree.engine.tree_context import TreeAttentionContext, rewrite_accepted_kv
from vllm_dominotree.engine.verify import tree_rows
from vllm_dominotree.tree.builder import DraftTree


def _tree(tokens_parents: list[tuple[int, int]]) -> DraftTree:
    tree = DraftTree.root(5)
    for token, parent in tokens_parents:
        tree.add(token, parent, 0.0)
    return tree


def test_accepted_paths_move_to_the_slots_after_their_roots():
    page, blocks = 4, 8
    # Two requests: a 5-node tree at rows 2..6 (root position 9), a 4-node one at rows
    # 9..12 (root position 3); rows 0-1 and 7-8 belong to other requests.
    first = _tree([(11, 0), (12, 0), (13, 2), (14, 1)])
    second = _tree([(21, 0), (22, 1), (23, 0)])
    trees = [tree_rows(0, 2, 9, first.tokens[1:], first),
             tree_rows(1, 9, 3, second.tokens[1:], second)]  # fmt: skip
    slot_mapping = torch.tensor([30, 31, 9, 10, 11, 12, 13, 0, 1, 3, 4, 5, 6])
    ctx = TreeAttentionContext(trees, frozenset({"layer"}))
    kv_cache = torch.randn(blocks, 2, page, 8)
    before = kv_cache.clone()
    ctx.keep_cache("layer", kv_cache, slot_mapping)

    def slot(s: int) -> torch.Tensor:
        return before[s // page, :, s % page]

    # first: accepted path 2 -> 3 (rows 4, 5); second: path 3 (row 12).
    rewrite_accepted_kv({}, ctx, [(trees[0], [2, 3]), (trees[1], [3])])
    assert torch.equal(kv_cache[10 // page, :, 10 % page], slot(11))  # node 2 -> position 1
    assert torch.equal(kv_cache[11 // page, :, 11 % page], slot(12))  # node 3 -> position 2
    assert torch.equal(kv_cache[4 // page, :, 4 % page], slot(6))  # second's node 3 -> 1
    moved = {10, 11, 4}
    for s in range(blocks * page):
        if s not in moved:
            assert torch.equal(kv_cache[s // page, :, s % page], slot(s)), s
