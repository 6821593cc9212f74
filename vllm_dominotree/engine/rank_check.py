"""Tensor parallelism: every rank builds the same trees, and a divergence fails loudly.

Every tensor-parallel rank runs the whole runner: it verifies, accepts and drafts on its
own share of the heads, and builds the next trees itself. The builder's inputs (the
drafter's hidden rows and logits, all-reduced / all-gathered by vLLM's layers) and the
sampler's inputs (the target's gathered logits, the seeded generators and the same
global seed on every rank) are identical across ranks, and the builder and the
acceptance are deterministic functions of them (ties break in push order, the top-k
and argmax run on the same values), so every rank verifies the same trees and accepts
the same paths. Building on every rank costs no communication; broadcasting rank 0's
trees would cost one collective per step and still need the same acceptance everywhere.

What must not happen silently is a rank that drafts something else (a kernel that is
not deterministic across devices, a future change that breaks the argument above): its
K/V would silently belong to other tokens. So after each build the ranks compare one
fingerprint of their trees over the CPU group (one small all-gather); a mismatch stops
the engine with a message naming the ranks. `DOMINOTREE_TP_TREE_CHECK=0` turns it off.
"""

from __future__ import annotations

import os

import torch

from ..tree.builder import DraftTree


def checks_enabled() -> bool:
    return os.environ.get("DOMINOTREE_TP_TREE_CHECK", "1") != "0"


def fingerprint(trees: list[DraftTree]) -> int:
    """A 63-bit digest of the trees' tokens and shapes, equal on equal trees in any
    process (tuples of ints hash the same everywhere: no hash randomization for ints)."""
    return hash(tuple((tuple(t.tokens), tuple(t.parents)) for t in trees)) & (2**63 - 1)


class RankTreeCheck:
    """Compares the ranks' trees after every build (tensor-parallel engines only)."""

    def __init__(self, group, rank: int, world_size: int):
        self.group = group  # vLLM's TP CPU (gloo) process group
        self.rank = rank
        self.world_size = world_size
        self.checked = 0

    def __call__(self, trees: list[DraftTree]) -> None:
        mine = torch.tensor([fingerprint(trees)], dtype=torch.int64)
        every = [torch.zeros_like(mine) for _ in range(self.world_size)]
        torch.distributed.all_gather(every, mine, group=self.group)
        values = [int(v) for v in every]
        self.checked += 1
        if len(set(values)) > 1:
            differ = [r for r, v in enumerate(values) if v != values[0]]
            raise RuntimeError(
                f"dominotree: tensor-parallel ranks built different draft trees at step "
                f"{self.checked} (ranks {differ} differ from rank 0; fingerprints {values}); "
                "their K/V would belong to different tokens, so the engine stops here. "
                "This is a bug: please report it with the model and options used"
            )


def make_rank_check() -> RankTreeCheck | None:
    from vllm.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
        get_tp_group,
    )

    world = get_tensor_model_parallel_world_size()
    if world == 1 or not checks_enabled():
        return None
    return RankTreeCheck(get_tp_group().cpu_group, get_tensor_model_parallel_rank(), world)
