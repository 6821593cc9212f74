"""The ancestor sets of tree rows: bitmasks (engine) and the dense mask (reference)."""

from __future__ import annotations

import numpy as np
import torch

from vllm_dominotree.tree.ancestry import (
    DEPTH,
    NEEDS_FIX,
    NUM_FIELDS,
    PARENT,
    TOKEN,
    ancestor_mask,
    describe_slots,
    preorder_ranks,
    tree_bits,
)
from vllm_dominotree.tree.device_builder import UNUSED as PAD_PARENT


def test_tree_bits():
    parents = torch.tensor([[-1, 0, 0, 1, 3, PAD_PARENT]])
    ancestors, siblings, needs_fix = tree_bits(parents)
    assert ancestors[0].tolist() == [0, 0b1, 0b10, 0b101, 0b1101, 0b10000]
    assert siblings[0].tolist() == [0, 0, 0b1, 0, 0, 0]
    assert needs_fix[0].tolist() == [False, False, True, True, True, False]
    chain = torch.tensor([list(range(-1, 64))])  # 65 rows: bit 63 is the sign bit
    ancestors, _, needs_fix = tree_bits(chain)
    assert ancestors[0, 64] == -1 and not needs_fix.any()


def walked_mask(parents: list[int]) -> torch.Tensor:
    """Row i sees j iff walking i's parents reaches j."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        node = i
        while node >= 0:
            mask[i, node] = True
            node = parents[node]
    return mask


def test_ancestor_mask_is_the_walk_up_the_parents():
    gen = torch.Generator().manual_seed(0)
    for n in (1, 2, 9, 33, 65):
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
        assert torch.equal(ancestor_mask(parents), walked_mask(parents)), n
    chain = list(range(-1, 64))
    assert torch.equal(ancestor_mask(chain), torch.ones(65, 65, dtype=torch.bool).tril())


def test_tree_bits_of_random_batches_are_the_walks():
    """Every output of tree_bits for a batch of random trees (some padded), against
    walking each row's parents."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(1, 66))
        batch = []
        for _ in range(int(rng.integers(1, 6))):
            size = int(rng.integers(1, n + 1))
            batch.append(
                [-1] + [int(rng.integers(i)) for i in range(1, size)] + [PAD_PARENT] * (n - size)
            )
        ancestors, siblings, needs_fix = (t.numpy() for t in tree_bits(torch.tensor(batch)))
        for b, row in enumerate(batch):
            real = [p for p in row if p != PAD_PARENT]
            mask = walked_mask(real).numpy()
            for i in range(len(row)):
                own = np.int64(1) << np.int64(i - 1) if i >= 1 else np.int64(0)
                if i >= len(real):  # padding keeps only its own bit
                    assert ancestors[b, i] == own and not needs_fix[b, i]
                    continue
                bits = sum(
                    (np.int64(1) << np.int64(j - 1) for j in range(1, i + 1) if mask[i, j]),
                    np.int64(0),
                )
                assert ancestors[b, i] == bits
                earlier = [j for j in range(1, i) if i >= 1 and real[j] == real[i]]
                assert siblings[b, i] == sum(
                    (np.int64(1) << np.int64(j - 1) for j in earlier), np.int64(0)
                )
                assert needs_fix[b, i] == (i >= 1 and not mask[i, : i + 1].all())


def depth_first(parents: list[int]) -> list[int]:
    """Each node's row in a depth-first walk from the root, children in row order (a
    slot without a node, parent PAD_PARENT, keeps its row)."""
    children = [[] for _ in parents]
    for i, p in enumerate(parents):
        if p >= 0:
            children[p].append(i)
    order, stack = [], [0]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(children[node]))
    rows = list(range(len(parents)))
    for row, node in enumerate(order):
        rows[node] = row
    return rows


def test_preorder_ranks_are_the_depth_first_walk():
    """Random trees of up to 65 slots (bit 63 included), some slots without a node."""
    gen = np.random.default_rng(0)
    for _ in range(200):
        n = int(gen.integers(1, 66))
        used = int(gen.integers(1, n + 1))
        parents = [-1] + [int(gen.integers(i)) for i in range(1, used)] + [PAD_PARENT] * (n - used)
        assert preorder_ranks(torch.tensor([parents]))[0].tolist() == depth_first(parents)


def test_described_trees_are_the_same_trees_in_preorder():
    """describe_slots renumbers: the same root-to-node token paths, siblings in their
    order, each parent before its children, the best child's line first (rows 1, 2)."""
    tokens = torch.tensor([[7, 11, 12, 13, 14, -1]])
    parents = torch.tensor([[-1, 0, 0, 1, 3, PAD_PARENT]])  # pop order: 2 before 1's line
    depths = torch.tensor([[0, 1, 1, 2, 3, 0]])
    out = torch.zeros(NUM_FIELDS, 1, 6, dtype=torch.long)
    describe_slots(tokens, parents, depths, out)
    assert out[TOKEN, 0].tolist() == [7, 11, 13, 14, 12, -1]
    assert out[PARENT, 0].tolist() == [-1, 0, 1, 2, 0, PAD_PARENT]
    assert out[DEPTH, 0].tolist() == [0, 1, 2, 3, 1, 1]
    assert out[NEEDS_FIX, 0].tolist() == [0, 0, 0, 0, 1, 0]  # rows 1..3 are causal now
