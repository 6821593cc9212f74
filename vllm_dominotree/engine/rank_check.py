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
K/V would silently belong to other tokens. So after each build every rank digests what
the next step will verify (the builder's table: tokens and parents of every slot) on the
device, copies the digest to the host without waiting, and at the next build the ranks
compare the previous digests over the CPU group (one small all-gather); a mismatch stops
the engine with a message naming the ranks. A step late, so that no step waits for its
trees; every rank compares at the same builds, so the collectives line up.
`DOMINOTREE_TP_TREE_CHECK=0` turns it off.
"""

from __future__ import annotations

import os

import torch

from ..tree.ancestry import PARENT, TOKEN
from .acceptance import splitmix


def checks_enabled() -> bool:
    return os.environ.get("DOMINOTREE_TP_TREE_CHECK", "1") != "0"


def digest(table: torch.Tensor) -> torch.Tensor:
    """[] int64: a digest of the slots' tokens and parents ([fields, n, slots] table),
    equal on equal tables on any device (wrapping integer arithmetic, a fixed order)."""
    values = table[[TOKEN, PARENT]].flatten()
    where = torch.arange(values.numel(), device=values.device)
    return (splitmix(values ^ splitmix(where))).sum()


class RankTreeCheck:
    """Compares the ranks' trees a build late (tensor-parallel engines only)."""

    def __init__(self, group, rank: int, world_size: int, device: torch.device):
        self.group = group  # vLLM's TP CPU (gloo) process group
        self.rank = rank
        self.world_size = world_size
        self.checked = 0
        self._digest = torch.zeros(1, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._pending = False

    def __call__(self, table: torch.Tensor) -> None:
        """table: this build's [fields, requests, slots]; the previous build is compared."""
        if self._pending:
            if self._copied is not None:
                self._copied.synchronize()
            self._compare(self._digest.clone())
        self._digest.copy_(digest(table)[None], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        self._pending = True

    def _compare(self, mine: torch.Tensor) -> None:
        every = [torch.zeros_like(mine) for _ in range(self.world_size)]
        torch.distributed.all_gather(every, mine, group=self.group)
        values = [int(v) for v in every]
        self.checked += 1
        if len(set(values)) > 1:
            differ = [r for r, v in enumerate(values) if v != values[0]]
            raise RuntimeError(
                f"dominotree: tensor-parallel ranks built different draft trees at build "
                f"{self.checked} (ranks {differ} differ from rank 0; digests {values}); "
                "their K/V would belong to different tokens, so the engine stops here. "
                "This is a bug: please report it with the model and options used"
            )


def make_rank_check(device: torch.device) -> RankTreeCheck | None:
    from vllm.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
        get_tp_group,
    )

    world = get_tensor_model_parallel_world_size()
    if world == 1 or not checks_enabled():
        return None
    return RankTreeCheck(get_tp_group().cpu_group, get_tensor_model_parallel_rank(), world, device)
