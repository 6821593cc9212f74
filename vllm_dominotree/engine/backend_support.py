"""Which attention-layer features each tree backend implements, checked on the layer.

Both backends check a target layer when it first verifies trees (on CUDA that is while
vLLM captures its graphs, at start-up), and name what the model uses that they lack.
"""

from __future__ import annotations

from vllm.v1.attention.backend import AttentionType

FEATURES = {
    "encoder attention": lambda impl: impl.attn_type != AttentionType.DECODER,
    "ALiBi": lambda impl: impl.alibi_slopes is not None,
    "sliding windows": lambda impl: impl.sliding_window not in (None, (-1, -1), -1),
    "logit soft-capping": lambda impl: bool(impl.logits_soft_cap),
    "attention sinks": lambda impl: getattr(impl, "sinks", None) is not None,
    "a quantized KV cache": lambda impl: impl.kv_cache_dtype != "auto",
}
# The rows a tree changes are recomputed outside vLLM's own call: by the plugin's Triton
# fix-up on CUDA, and on CPU by vLLM's kernel over path requests, which the plugin calls
# for plain causal attention only (no window, soft cap, sinks or cache scales).
TREE_LACKS = tuple(FEATURES)


def check_supported(impl, lacks: tuple[str, ...], backend: str) -> None:
    """Raise if the layer uses a feature the tree backend lacks; a layer that passed is
    not checked again (a layer's features are fixed at start, and the check ran in every
    layer's every verification step: 0.1 ms of a CPU step, 2026-12-07)."""
    if getattr(impl, "_dominotree_supported", False):
        return
    found = [name for name in lacks if FEATURES[name](impl)]
    if found:
        raise NotImplementedError(f"dominotree: tree verification on {backend} lacks {found}")
    impl._dominotree_supported = True
