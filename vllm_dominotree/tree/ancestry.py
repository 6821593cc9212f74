"""Which rows of a draft tree see which: the ancestor sets, as bitmasks (the engine's
attention and acceptance) and as a dense mask (the reference decoder's attention).

Rows are a tree's nodes in topological order (parents[i] < i); row 0 is the root. Row
i's own bit is bit i - 1 (the root has none: every row sees it); budget <= 64 keeps a
tree's bits in one int64.
"""

from __future__ import annotations

import numpy as np
import torch


def _row_bits(num_rows: int) -> np.ndarray:
    """[n] int64: row i's own bit (i - 1), 0 for the root."""
    offsets = np.arange(num_rows, dtype=np.int64)
    return np.where(offsets >= 1, np.left_shift(np.int64(1), np.maximum(offsets - 1, 0)), 0)


def tree_bits(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """parents: [B, n] row offsets (-1 the root, any other negative value a padding row
    that belongs to no tree; rows past a tree's end are ignored by the caller). Returns
    [B, n] each:
      ancestors        the bits of the row and its ancestors (the root excepted)
      siblings_before  the bits of the row's earlier siblings
      needs_fix        the row's ancestor set is not its causal prefix (a row that a
                       causal kernel gets wrong; never the root, never a chain's rows)."""
    b, n = parents.shape
    own = np.broadcast_to(_row_bits(n), (b, n))
    real = parents >= 0
    # Pointer jumping: ancestors[i] holds the bits from i up to, not including, up[i];
    # each round doubles that stretch, so a path of d rows takes about log2(d) rounds.
    ancestors = own.copy()
    up = np.where(real, parents, -1)
    rows = np.arange(b)[:, None]
    while (up >= 0).any():
        above = up >= 0
        at = np.maximum(up, 0)
        ancestors = ancestors | np.where(above, ancestors[rows, at], 0)
        up = np.where(above, up[rows, at], -1)
    earlier = np.tri(n, n, -1, dtype=bool)[None]  # [1, i, j]: j < i
    same_parent = (parents[:, :, None] == parents[:, None, :]) & real[:, :, None] & earlier
    # Disjoint bits: their wrapping int64 sum is their OR.
    siblings = (same_parent * own[:, None, :]).sum(-1, dtype=np.int64)
    causal = np.bitwise_or.accumulate(own, axis=1)
    needs_fix = real & (ancestors != causal)
    return ancestors, siblings, needs_fix


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: row i sees column j iff j is i, one of its ancestors, or the root."""
    ancestors = tree_bits(np.asarray([parents], dtype=np.int64))[0][0]  # [n]
    n = len(parents)
    bits = (ancestors[:, None] >> np.maximum(np.arange(n) - 1, 0)[None, :]) & 1
    bits[:, 0] = 1  # the root
    return torch.from_numpy(bits.astype(bool))
