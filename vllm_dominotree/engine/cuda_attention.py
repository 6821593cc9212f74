"""Tree verification on CUDA: vLLM's FlashAttention and Triton backends plus a fix-up.

The stock kernel runs every row as usual (all K/V written, non-tree rows final); then,
for the branching trees of the step, the Triton tree kernel (kernels/tree_attention.py)
recomputes the tree rows with ancestor-only attention from the same paged cache. Both
backends keep K/V as [blocks, kv heads, slots, 2 * head dim], which the kernel reads
through a [blocks, slots, kv heads, head dim] view, and in which accepted rows later
move slot to slot (tree_context.move_slots).
"""

from __future__ import annotations

from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl

from ..kernels.tree_attention import tree_attention
from .tree_context import active_context


class TreeFixupMixin:
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, **kwargs):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, **kwargs)
        ctx = active_context()
        if ctx is None or attn_metadata is None or layer.layer_name not in ctx.layer_names:
            return out
        unsupported = {
            "encoder attention": self.attn_type != AttentionType.DECODER,
            "ALiBi": self.alibi_slopes is not None,
            "sliding windows": self.sliding_window not in (None, (-1, -1), -1),
            "logit soft-capping": bool(self.logits_soft_cap),
            "attention sinks": getattr(self, "sinks", None) is not None,
            "a quantized KV cache": self.kv_cache_dtype != "auto",
        }
        found = [name for name, present in unsupported.items() if present]
        if found:
            raise NotImplementedError(f"dominotree: tree verification on CUDA lacks {found}")
        ctx.keep_cache(layer.layer_name, kv_cache, attn_metadata.slot_mapping)
        if ctx.branching:
            key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
            tree_attention(
                query, key_cache, value_cache, attn_metadata.block_table,
                ctx.kernel_meta(query.device), self.scale,
                output.view(output.shape[0], self.num_heads, self.head_size),
            )  # fmt: skip
        return out


class TreeFlashAttentionImpl(TreeFixupMixin, FlashAttentionImpl):
    pass


class TreeFlashAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return TreeFlashAttentionImpl


class TreeTritonAttentionImpl(TreeFixupMixin, TritonAttentionImpl):
    pass


class TreeTritonAttentionBackend(TritonAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return TreeTritonAttentionImpl
