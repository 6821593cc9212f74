"""Tree verification on CUDA: vLLM's FlashAttention and Triton backends plus a fix-up.

The stock kernel runs every row causally, which is exactly right for the rows whose
ancestors are all the rows before them (roots, chains); then, for the target's layers,
the Triton tree kernel (kernels/tree_attention.py) recomputes the other tree rows with
ancestor-only attention from the same paged cache. Both launches read only device
buffers (the attention metadata and the published step, engine/tree_step.py), so a
forward captured in a FULL CUDA graph replays them for every step (the runner marks
graph capture, whose warm-ups compile and whose captures record the launch); in eager
or piecewise execution a step whose trees need no fix skips the second launch. Both
backends keep K/V as [blocks, kv heads, slots, 2 * head dim], which the kernel reads
through a [blocks, slots, kv heads, head dim] view.
"""

from __future__ import annotations

from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl

from ..kernels.tree_attention import TreeAttention
from .backend_support import TREE_LACKS, check_supported
from .tree_step import installed

_KERNELS: dict[tuple, TreeAttention] = {}  # one per geometry: its buffers' addresses stay


class TreeFixupMixin:
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, **kwargs):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, **kwargs)
        verification = installed()
        if (
            verification is None
            or attn_metadata is None
            or layer.layer_name not in verification.layers
        ):
            return out
        step = verification.step
        if not verification.capturing and (step is None or not step.any_fix):
            return out
        check_supported(self, TREE_LACKS, "CUDA")
        geometry = (self.num_heads, self.head_size, verification.rows_per_tree, query.device)
        kernel = _KERNELS.get(geometry)
        if kernel is None:
            kernel = _KERNELS[geometry] = TreeAttention(*geometry)
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        buffers = verification.buffers
        kernel(
            query,
            key_cache,
            value_cache,
            attn_metadata.block_table,
            attn_metadata.query_start_loc,
            attn_metadata.seq_lens,
            buffers.token_ancestors,
            buffers.token_needs_fix,
            self.scale,
            output.view(output.shape[0], self.num_heads, self.head_size),
        )
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
