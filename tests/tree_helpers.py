"""Small helpers the tests share about draft trees."""

from __future__ import annotations

from pathlib import Path

import torch

from vllm_dominotree.demo.toy_pair import PairSpec, drafter_config, drafter_tensors
from vllm_dominotree.drafter.checkpoint import write_checkpoint
from vllm_dominotree.tree import DraftTree


def node_path(tree: DraftTree, node: int) -> list[int]:
    """Nodes from the root's child down to `node` (root excluded)."""
    out = []
    while node != 0:
        out.append(node)
        node = tree.parents[node]
    return out[::-1]


def random_domino_checkpoint(folder: Path, vocab: int, block_size: int) -> Path:
    """A Domino checkpoint with random weights (the toy pair's shapes, hidden 16)."""
    spec = PairSpec(vocab=vocab, hidden=16, block_size=block_size)
    gen = torch.Generator().manual_seed(7)
    tensors = {
        name: 0.5 * torch.randn(t.shape, generator=gen) for name, t in drafter_tensors(spec).items()
    }
    return write_checkpoint(folder, drafter_config(spec), tensors)


def random_step(hidden_size: int, vocab: int, drafts: int, requests: int, seed: int):
    """A step's random scorer inputs: the drafter's rows [R, K, H], marginal logits
    [R, K, V], an embedding table [V, H] and the anchors (R token ids)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(requests, drafts, hidden_size, generator=gen)
    base = 3 * torch.randn(requests, drafts, vocab, generator=gen)
    embed = torch.randn(vocab, hidden_size, generator=gen)
    anchors = torch.randint(0, vocab, (requests,), generator=gen).tolist()
    return hidden, base, embed, anchors
