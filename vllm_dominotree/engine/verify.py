"""One step's tree verification: which rows are tree nodes, and what was accepted.

The scheduler gives every request 1 + n verification rows: the root (the last
committed token) and the n draft tokens the proposer returned last step, in the tree's
topological order (possibly cut short by the scheduler, which keeps a closed subtree,
or padded). Rows keep their own KV slots; only positions and attention follow the tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..tree.acceptance import accept
from ..tree.builder import ROOT, DraftTree, ancestor_mask


@dataclass
class TreeRows:
    """A request's verification rows in this step's flattened batch."""

    batch_index: int  # the request's row in query_start_loc / seq_lens
    row_start: int  # its first token row in the batch
    start: int  # position of the root (num_computed_tokens)
    tree: DraftTree  # nodes 0 .. num_real - 1 are verified
    num_real: int  # tree nodes among the rows (root included)
    parents: list[int]  # per row; padding rows hang off the root (never accepted)
    depths: list[int]  # per row

    @property
    def num_rows(self) -> int:
        return len(self.parents)

    @property
    def is_chain(self) -> bool:
        """Causal attention over the rows is already right for a chain."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def ancestor_mask(self) -> torch.Tensor:
        """[rows, rows] bool: row i sees row j iff j is i or one of its ancestors."""
        return ancestor_mask(self.parents)


def tree_rows(
    batch_index: int,
    row_start: int,
    start: int,
    drafts: list[int],
    tree: DraftTree | None,
) -> TreeRows:
    """Match the scheduled drafts against the tree proposed for them. Placeholder drafts
    (-1, scheduled before any proposal) and a missing tree verify as a chain of those
    tokens, which the target never matches. Real drafts that differ from the tree are a
    bug, and fail loudly rather than verifying a different tree than was drafted."""
    n = len(drafts)
    if tree is None or all(t < 0 for t in drafts):
        chain = DraftTree.root(-1)
        for i, t in enumerate(drafts):
            chain.add(t, i, 0.0)
        return TreeRows(batch_index, row_start, start, chain, n + 1, list(range(-1, n)),
                        list(range(n + 1)))  # fmt: skip
    num_real = min(n + 1, tree.num_nodes)
    if drafts[: num_real - 1] != tree.tokens[1:num_real]:
        raise RuntimeError(
            f"dominotree: scheduled drafts {drafts[:8]}... differ from the proposed tree "
            f"{tree.tokens[1:9]}...; the runner lost track of its trees"
        )
    parents = tree.parents[:num_real] + [ROOT] * (n + 1 - num_real)
    depths = tree.depths[:num_real] + [1] * (n + 1 - num_real)
    return TreeRows(batch_index, row_start, start, tree, num_real, parents, depths)


@dataclass
class Acceptance:
    """A request's outcome: the accepted tree nodes (= row offsets, root excluded,
    root to leaf) and the bonus token drawn where the walk stopped."""

    path: list[int]
    bonus: int
    tokens: list[int] = field(default_factory=list)  # path tokens then the bonus

    @property
    def moved(self) -> bool:
        """True if the path is not rows 1..k, i.e. its KV must move to the first slots."""
        return self.path != list(range(1, len(self.path) + 1))


def accept_rows(rows: TreeRows, target: list[int]) -> Acceptance:
    """Walk the request's tree with the target's token of every row (target[i]: row i)."""
    tree = rows.tree
    if rows.num_real < tree.num_nodes:  # the scheduler verified a closed subtree
        tree = _prefix_tree(tree, rows.num_real)
    path, bonus = accept(tree, target)
    return Acceptance(path, bonus, [tree.tokens[n] for n in path] + [bonus])


def _prefix_tree(tree: DraftTree, num_nodes: int) -> DraftTree:
    out = DraftTree.root(tree.tokens[0])
    for i in range(1, num_nodes):
        out.add(tree.tokens[i], tree.parents[i], tree.scores[i])
    return out
