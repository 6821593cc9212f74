"""A debug switch, DOMINOTREE_CHECK_TREE_ATTENTION=1: every tree row that the CUDA
attention recomputed (fix-up or path requests) checked against the dense float32
reference (kernels/tree_attention.tree_attention_reference) in the forward itself.

It answers one question that outputs alone cannot: when speculative output leaves the
target's own, are the recomputed rows wrong, or right up to rounding? It waits for the
GPU and loops in Python per request, so it runs only in forwards that Python executes
(`enforce_eager=True`, or the piecewise steps); under FULL CUDA graphs it sees nothing,
and its count of checked rows says so. The engine's stats carry its figures
(`dominotree_stats()["tree_attention_check"]`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..kernels.tree_attention import tree_attention_reference


def enabled() -> bool:
    return os.environ.get("DOMINOTREE_CHECK_TREE_ATTENTION", "0") == "1"


@dataclass
class AttentionCheck:
    layers: int = 0  # layer forwards checked
    rows: int = 0  # recomputed rows checked (summed over layers)
    max_error: float = 0.0  # the largest |row - reference| element seen
    worst_layer: str = ""
    # The largest of a layer's max |row - reference| over its max |reference|: bf16's
    # rounding is relative (a row of large values rounds by more), a wrong row is not.
    max_relative_error: float = 0.0

    def record(
        self,
        layer: str,
        query: torch.Tensor,  # [T, H, D]
        key_cache: torch.Tensor,  # [blocks, page, KVH, D]
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        query_start: torch.Tensor,  # [R + 1]
        seq_lens: torch.Tensor,  # [R]
        ancestors: torch.Tensor,  # [>= T]
        needs_fix: torch.Tensor,  # [>= T]
        scale: float,
        rows: torch.Tensor,  # [T, H, D] the layer's output after the recomputation
    ) -> None:
        if rows.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        num_tokens = query.shape[0]
        fixed = needs_fix[:num_tokens].bool()
        if not fixed.any():
            return
        want = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
        tree_attention_reference(
            query.float(),
            key_cache,
            value_cache,
            block_table,
            query_start,
            seq_lens,
            ancestors[:num_tokens],
            needs_fix[:num_tokens],
            scale,
            want,
        )
        reference = want[:num_tokens][fixed]
        error = float((rows[:num_tokens][fixed].float() - reference).abs().max())
        largest = float(reference.abs().max())
        self.layers += 1
        self.rows += int(fixed.sum())
        if error > self.max_error:
            self.max_error, self.worst_layer = error, layer
        if largest > 0:
            self.max_relative_error = max(self.max_relative_error, error / largest)


CHECK = AttentionCheck()
