"""Which tree attention a runner's verification takes on CUDA, and its path tables.

Both runners (runner.py on vLLM's V1, v2_runner.py on its V2) verify trees through the
same attention backends (cuda_attention.py); this is where the mode is chosen from
DOMINOTREE_CUDA_TREE_ATTENTION (config.attention_mode) and the target's backend, once,
when the model is loaded, and checked once the KV cache exists.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..config import attention_mode, path_splits
from .backend_support import runs_fa3
from .tree_paths import PathTables, slot_view
from .tree_step import TreeVerification

# The V2 runner has no one pass yet: it would need V2's graph dispatch kept from
# replaying a FULL graph without the stock pass for a step that is not all trees
# (docs/v2-runner-port.md, section F).
V2_MODES = ("auto", "fixup", "paths")


def cuda_tree_attention(fa3: bool, kv_update_in_forward: bool, one_pass_allowed: bool) -> str:
    """The mode a CUDA runner verifies trees with: "one-pass", "one-pass-fixup", "paths"
    or "fixup" (config.attention_mode). "auto": one pass where the target runs FA3 and
    its attention does not also write the KV cache (one pass skips that call), paths
    where it does or where one pass is not allowed (the V2 runner), else fixup."""
    mode = attention_mode()
    if not one_pass_allowed and mode not in V2_MODES:
        raise ValueError(
            f"dominotree: DOMINOTREE_CUDA_TREE_ATTENTION={mode} is not available with "
            f"model_runner 'v2' yet; use one of {V2_MODES} or model_runner 'v1'"
        )
    if mode != "auto":
        return mode
    if not fa3:
        return "fixup"
    return "one-pass" if one_pass_allowed and not kv_update_in_forward else "paths"


def configure(
    verification: TreeVerification,
    target_layer,
    *,
    one_pass_allowed: bool,
    max_paths: int,
    max_tokens: int,
    max_len: int,
    device: torch.device,
) -> str:
    """Set the verification's path tables and one-pass flag for a CUDA runner (allocated
    here, before vLLM measures the memory left for the KV cache) -> the mode's name."""
    mode = cuda_tree_attention(
        runs_fa3(target_layer),
        target_layer.attn_backend.forward_includes_kv_cache_update,
        one_pass_allowed,
    )
    if mode in ("paths", "one-pass"):
        verification.paths = PathTables(
            max_paths=max_paths,
            max_tokens=max_tokens,
            max_len=max_len,
            device=device,
            splits=path_splits(),
        )
    verification.one_pass = mode.startswith("one-pass")
    if verification.one_pass:
        verification.all_rows = torch.ones_like(verification.buffers.token_needs_fix)
    return mode


def check_paths_backend(
    verification: TreeVerification, layer, warm_build: Callable[[bool], None]
) -> None:
    """Path requests need FA3 and a cache that a one-slot page view can address: checked
    once the KV cache exists, before any graph is captured. warm_build(every_row) builds
    one tree of no rows, so that the build's Triton kernels compile now, on the buffers
    every step passes, not on the first request's step."""
    if not runs_fa3(layer):
        raise ValueError(
            f"dominotree: DOMINOTREE_CUDA_TREE_ATTENTION={attention_mode()} needs vLLM's "
            f"FlashAttention backend with FA3; this target runs {type(layer.impl).__name__}"
            " (float32 models use Triton): unset it or set it to fixup"
        )
    slot_view(layer.kv_cache.transpose(1, 2).split(layer.impl.head_size, dim=-1)[0])
    for every_row in {False, verification.one_pass}:
        warm_build(every_row)
    verification.paths.clear()
