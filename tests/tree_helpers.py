"""Small helpers the tests share about draft trees."""

from __future__ import annotations

from vllm_dominotree.tree import DraftTree


def node_path(tree: DraftTree, node: int) -> list[int]:
    """Nodes from the root's child down to `node` (root excluded)."""
    out = []
    while node != 0:
        out.append(node)
        node = tree.parents[node]
    return out[::-1]
