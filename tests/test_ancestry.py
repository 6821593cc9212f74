"""The ancestor sets of tree rows: bitmasks (engine) and the dense mask (reference)."""

from __future__ import annotations

import numpy as np
import torch

from vllm_dominotree.tree.ancestry import ancestor_mask, tree_bits
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
