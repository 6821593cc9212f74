"""Which rows of a draft tree see which: the ancestor sets, as bitmasks (the engine's
attention and acceptance) and as a dense mask (the reference decoder's attention).

Rows are a tree's nodes in topological order (parents[i] < i); row 0 is the root. Row
i's own bit is bit i - 1 (the root has none: every row sees it); budget <= 64 keeps a
tree's bits in one int64. The builders number nodes in pop order; what a verification
step reads (`describe_slots`) numbers them in depth-first preorder.

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


def preorder_ranks(parents: torch.Tensor) -> torch.Tensor:
    """parents: [B, n] long (topological order, as tree_bits takes them; slots without a
    node after every node). -> [B, n] long: each node's row in depth-first preorder,
    children in their order (a slot without a node keeps its own). Node j comes before
    node i when j is an ancestor of i, or where their paths part, j's side holds the
    smaller row: the lowest bit of the bits only j's path has (rows grow with depth
    along a path) is below the lowest of those only i's has. Fixed steps, no sort."""
    bits = tree_bits(parents)[0]
    node = (parents >= 0) | (parents == -1)
    mine, theirs = bits[:, :, None], bits[:, None, :]  # [B, i, j]
    only_i, only_j = mine & ~theirs, theirs & ~mine
    # x & -x: the lowest set bit; minus one orders them as unsigned (bit 63 included).
    low_i, low_j = (only_i & -only_i) - 1, (only_j & -only_j) - 1
    ancestor = (only_j == 0) & (only_i != 0)
    earlier_branch = (only_i != 0) & (only_j != 0) & (low_j < low_i)
    before = (ancestor | earlier_branch) & node[:, None, :]
    rank = before.sum(-1)
    return torch.where(node, rank, torch.arange(parents.shape[1], device=parents.device))


def in_preorder(
    tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Trees in slot form ([B, n] long each, pop order) renumbered in depth-first
    preorder (preorder_ranks): the same trees, whose root-to-leaf paths each own a run
    of consecutive rows, leaf after leaf. So one pass's FA3 path requests take the
    forward's rows in their own order (engine/cuda_attention.attend_paths: no gathers),
    and the best child's line is rows 1, 2, ... (an accepted path there moves no K/V)."""
    rank = preorder_ranks(parents)
    renumbered = torch.where(parents >= 0, rank.gather(1, parents.clamp(min=0)), parents)
    return tuple(
        torch.empty_like(field).scatter_(1, rank, field) for field in (tokens, renumbered, depths)
    )


def describe_slots(
    tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, out: torch.Tensor
) -> None:
    """Trees in slot form ([B, n] long each: pop order, parents -1 for the root and
    negative for slots that hold no node) -> out [NUM_FIELDS, B, n] long, what a
    verification step reads of each slot (engine/tree_step.py), the nodes in preorder
    (in_preorder). Slots without a node keep depth 1 (any position will do: they are
    never accepted) and see only the root and themselves."""
    tokens, parents, depths = in_preorder(tokens, parents, depths)
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
