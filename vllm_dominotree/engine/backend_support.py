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
# The rows a tree changes are recomputed by the plugin's own attention (a Triton fix-up
# on CUDA, a masked attention in torch on CPU), which implements plain causal attention only.
TREE_LACKS = tuple(FEATURES)


def check_supported(impl, lacks: tuple[str, ...], backend: str) -> None:
    found = [name for name in lacks if FEATURES[name](impl)]
    if found:
        raise NotImplementedError(f"dominotree: tree verification on {backend} lacks {found}")
