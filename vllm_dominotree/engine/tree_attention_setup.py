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
from ..kernels.tree_merge import check_merge_shape
from .tree_paths import PathTables, slot_view
from .tree_step import TreeVerification

# The modes that need no one pass, for an engine that cannot take one.
NO_ONE_PASS_MODES = ("auto", "fixup", "paths")


def runs_fa3(layer) -> bool:
    """The layer runs vLLM's FlashAttention backend with FA3 (bf16 / fp16 on Hopper; float32
    models run Triton): path requests can go through it (tree_paths.py)."""
    from .cuda_attention import TreeFlashAttentionImpl  # imports vLLM's CUDA backends

    impl = getattr(layer, "impl", None)
    return isinstance(impl, TreeFlashAttentionImpl) and impl.vllm_flash_attn_version == 3


def cuda_tree_attention(fa3: bool, kv_update_in_forward: bool, no_one_pass: str | None) -> str:
    """The mode a CUDA runner verifies trees with: "one-pass", "one-pass-fixup",
    "one-pass-merge", "paths" or "fixup" (config.attention_mode). "auto": one pass where
    the target runs FA3 and its attention does not also write the KV cache (one pass
    skips that call), paths where it does or where the engine cannot take one pass, else
    fixup. no_one_pass: why this engine cannot take one pass (None: it can)."""
    mode = attention_mode()
    if no_one_pass is not None and mode not in NO_ONE_PASS_MODES:
        raise ValueError(
            f"dominotree: DOMINOTREE_CUDA_TREE_ATTENTION={mode} is not available here: "
            f"{no_one_pass}; use one of {NO_ONE_PASS_MODES}"
        )
    if mode != "auto":
        return mode
    if not fa3:
        return "fixup"
    return "one-pass" if no_one_pass is None and not kv_update_in_forward else "paths"


def configure(
    verification: TreeVerification,
    target_layer,
    *,
    no_one_pass: str | None,
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
        no_one_pass,
    )
    if mode in ("paths", "one-pass", "one-pass-merge"):
        verification.paths = PathTables(
            max_paths=max_paths,
            max_tokens=max_tokens,
            max_len=max_len,
            device=device,
            splits=path_splits(),
        )
    verification.one_pass = mode.startswith("one-pass")
    if mode == "one-pass-merge":
        verification.prefix_lens = torch.zeros(max_tokens, dtype=torch.int32, device=device)
    if verification.one_pass:
        verification.all_rows = torch.ones_like(verification.buffers.token_needs_fix)
    return mode


def check_backend(
    verification: TreeVerification, layer, warm_build: Callable[[bool], None]
) -> None:
    """Once the KV cache exists, before any graph is captured: one pass skips the stock
    attention, so that call must not also write the KV cache; path requests need FA3 and
    a cache that a one-slot page view can address. warm_build(every_row) builds one tree
    of no rows, so that the build's Triton kernels compile now, on the buffers every
    step passes, not on the first request's step."""
    if verification.one_pass and layer.attn_backend.forward_includes_kv_cache_update:
        raise RuntimeError(
            f"dominotree: DOMINOTREE_CUDA_TREE_ATTENTION={attention_mode()} skips the "
            "stock attention, which in this vLLM also writes the KV cache; use paths "
            "or fixup"
        )
    if verification.paths is None:
        return
    if not runs_fa3(layer):
        raise ValueError(
            f"dominotree: DOMINOTREE_CUDA_TREE_ATTENTION={attention_mode()} needs vLLM's "
            f"FlashAttention backend with FA3; this target runs {type(layer.impl).__name__}"
            " (float32 models use Triton): unset it or set it to fixup"
        )
    if verification.merge:
        check_merge_shape(layer.impl.num_heads, layer.impl.num_kv_heads, layer.impl.head_size)
    slot_view(layer.kv_cache.transpose(1, 2).split(layer.impl.head_size, dim=-1)[0])
    for every_row in {False, verification.one_pass}:
        warm_build(every_row)
    verification.paths.clear()
