"""Which rows of a draft tree see which: the ancestor sets, as bitmasks (the engine's
attention and acceptance) and as a dense mask (the reference decoder's attention).

Rows are a tree's nodes in topological order (parents[i] < i); row 0 is the root. Row
i's own bit is bit i - 1 (the root has none: every row sees it); budget <= 64 keeps a
tree's bits in one int64.

`tree_bits` is plain torch with a fixed number of steps for a given row count, so the
device builder runs it inside its CUDA graph (tree/device_builder.py) and the host heap's
trees go through the very same function.
"""

from __future__ import annotations

import torch

# The fields of a described tree slot (`describe_slots`), in order (ANCESTORS .. DEPTH
# and NEEDS_FIX, DEPTH adjacent: the verification step copies them as slices).
TOKEN, PARENT, ANCESTORS, SIBLINGS, DEPTH, NEEDS_FIX = range(6)
NUM_FIELDS = 6


def own_bits(num_rows: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[n] int64: row i's own bit (i - 1), 0 for the root."""
    offsets = torch.arange(num_rows, device=device)
    return torch.where(offsets >= 1, torch.ones_like(offsets) << (offsets - 1).clamp(min=0), 0)


def tree_bits(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """parents: [B, n] long row offsets (-1 the root, any other negative value a padding
    row that belongs to no tree). Returns [B, n] each:
      ancestors        int64, the bits of the row and its ancestors (the root excepted)
      siblings_before  int64, the bits of the row's earlier siblings
      needs_fix        bool, the row's ancestor set is not its causal prefix (a row that
                       a causal kernel gets wrong; never the root, never a chain's rows)."""
    b, n = parents.shape
    own = own_bits(n, parents.device).expand(b, n)
    real = parents >= 0
    # Pointer jumping: ancestors[i] holds the bits from i up to, not including, up[i];
    # each round doubles that stretch, so ceil(log2(n)) rounds cover any path.
    ancestors = own.clone()
    up = torch.where(real, parents, -1)
    for _ in range(max(1, (n - 1).bit_length())):
        above = up >= 0
        at = up.clamp(min=0)
        ancestors = ancestors | torch.where(above, ancestors.gather(1, at), 0)
        up = torch.where(above, up.gather(1, at), -1)
    earlier = torch.ones(n, n, dtype=torch.bool, device=parents.device).tril(-1)  # j < i
    same_parent = (parents[:, :, None] == parents[:, None, :]) & real[:, :, None] & earlier
    # Disjoint bits: their wrapping int64 sum is their OR.
    siblings = (same_parent * own[:, None, :]).sum(-1)
    causal = own.cumsum(1)
    needs_fix = real & (ancestors != causal)
    return ancestors, siblings, needs_fix


def describe_slots(
    tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, out: torch.Tensor
) -> None:
    """Trees in slot form ([B, n] long each: pop order, parents -1 for the root and
    negative for slots that hold no node) -> out [NUM_FIELDS, B, n] long, what a
    verification step reads of each slot (engine/tree_step.py). Slots without a node
    keep depth 1 (any position will do: they are never accepted) and see only the root
    and themselves."""
    ancestors, siblings, needs_fix = tree_bits(parents)
    node = (parents >= 0) | (parents == -1)
    out[TOKEN] = tokens
    out[PARENT] = parents
    out[DEPTH] = torch.where(node, depths, 1)
    out[ANCESTORS] = ancestors
    out[SIBLINGS] = siblings
    out[NEEDS_FIX] = needs_fix.long()


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: row i sees column j iff j is i, one of its ancestors, or the root."""
    ancestors = tree_bits(torch.tensor([parents]))[0][0]  # [n]
    n = len(parents)
    bits = (ancestors[:, None] >> (torch.arange(n) - 1).clamp(min=0)[None, :]) & 1
    bits[:, 0] = 1  # the root
    return bits.bool()
