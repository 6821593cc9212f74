"""Tree verification inside vLLM's attention: the per-step context and the CPU backend.

vLLM's attention kernels know only causal (or fully non-causal) attention per request.
During the target's verification forward the runner publishes a `TreeAttentionContext`:
which rows belong to trees, their ancestor structure, and which layers are the target's
(the DFlash drafter's layers run through the same backend and must be left alone).
The backend then
- fixes the outputs of tree rows so that each attends the committed prefix, its
  ancestors and itself only (rows of chains are already right under causal attention);
- keeps a copy of the tree rows' K/V and slots, so that after acceptance the accepted
  path's K/V can be rewritten into the first slots with the backend's own cache writer
  (layout-agnostic KV compaction).

CPU (CPU_ATTN): after the stock kernel has run, each root-to-leaf path of a branching
tree is recomputed with the same kernel, causally, after temporarily writing the path's
K/V into the slots start .. start + depth; the canonical slots are restored at the end.
Reusing the kernel keeps every ISA-specific cache layout, sliding window and soft cap
the kernel supports; the cost is one kernel call per leaf.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from .verify import TreeRows


@dataclass
class TreeAttentionContext:
    trees: list[TreeRows]
    layer_names: frozenset[str]  # the target model's attention layers
    # layer name -> (key rows, value rows, slot rows) of every tree row in this step
    captured: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )

    def __post_init__(self) -> None:
        self.rows = torch.tensor(
            [t.row_start + i for t in self.trees for i in range(t.num_rows)], dtype=torch.long
        )
        self.branching = [t for t in self.trees if not t.is_chain]
        self.paths = {id(t): _leaf_paths(t.parents) for t in self.branching}

    def capture(self, layer_name, key, value, slot_mapping) -> None:
        rows = self.rows.to(key.device)
        self.captured[layer_name] = (key[rows].clone(), value[rows].clone(), slot_mapping[rows])

    def row_of(self, tree: TreeRows, offset: int) -> int:
        """Index into the captured rows of a tree's row `offset`."""
        base = 0
        for t in self.trees:
            if t is tree:
                return base + offset
            base += t.num_rows
        raise KeyError("tree not in this step")


_ACTIVE: TreeAttentionContext | None = None


@contextlib.contextmanager
def tree_attention(ctx: TreeAttentionContext | None):
    """Publish `ctx` to the attention backend for the duration of the target forward."""
    global _ACTIVE
    _ACTIVE = ctx
    try:
        yield
    finally:
        _ACTIVE = None


def _leaf_paths(parents: list[int]) -> list[tuple[list[int], int]]:
    """Root-to-leaf row paths, each with the index of its first row not already
    computed by an earlier path (only those rows' outputs are written)."""
    n = len(parents)
    has_child = [False] * n
    for p in parents[1:]:
        has_child[p] = True
    done = [False] * n
    out = []
    for leaf in range(n):
        if has_child[leaf]:
            continue
        path, node = [], leaf
        while node >= 0:
            path.append(node)
            node = parents[node]
        path.reverse()
        first_new = next(i for i, r in enumerate(path) if not done[r])
        for r in path:
            done[r] = True
        out.append((path, first_new))
    return out


class TreeCPUAttentionImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, **kwargs):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, **kwargs)
        ctx = _ACTIVE
        if ctx is None or attn_metadata is None or layer.layer_name not in ctx.layer_names:
            return out
        if self.attn_type != AttentionType.DECODER or self.alibi_slopes is not None:
            raise NotImplementedError(
                "dominotree: tree verification supports decoder self-attention without ALiBi"
            )
        ctx.capture(layer.layer_name, key, value, attn_metadata.slot_mapping)
        for tree in ctx.branching:
            self._tree_rows_by_paths(layer, query, key, value, kv_cache, attn_metadata,
                                     output, tree, ctx.paths[id(tree)])  # fmt: skip
        return out

    def _cache_write(self, layer, key, value, key_cache, value_cache, slots) -> None:
        ops.cpu_attn_reshape_and_cache(
            key, value, key_cache, value_cache, slots, layer.isa,
            k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype,
        )  # fmt: skip

    def _tree_rows_by_paths(self, layer, query, key, value, kv_cache, md, output, tree, paths):
        num_blocks, heads, block_size, _ = kv_cache.shape
        key_cache, value_cache = kv_cache.view(num_blocks, heads, 2 * block_size, -1).chunk(2, 2)
        s, e = tree.row_start, tree.row_start + tree.num_rows
        block_table = md.block_table[tree.batch_index : tree.batch_index + 1]
        for path, first_new in paths:
            rows = torch.tensor(path, dtype=torch.long) + s
            depth = len(path)
            self._cache_write(layer, key[rows], value[rows], key_cache, value_cache,
                              md.slot_mapping[s : s + depth].contiguous())  # fmt: skip
            new_rows = rows[first_new:]
            q = query[new_rows].contiguous()
            o = torch.empty_like(q)
            query_start = torch.tensor([0, len(new_rows)], dtype=torch.int32)
            seq_len = torch.tensor([tree.start + depth], dtype=torch.int32)
            schedule = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=1, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                head_dim=self.head_size, seq_lens=seq_len, dtype=query.dtype,
                query_start_loc=query_start, causal=True,
                sliding_window_size=self.sliding_window, isa=layer.isa,
                enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, kv_cache_dtype=self.kv_cache_dtype,
            )  # fmt: skip
            ops.cpu_attention_with_kv_cache(
                query=q, key_cache=key_cache, value_cache=value_cache, output=o,
                query_start_loc=query_start, seq_lens=seq_len, scale=self.scale, causal=True,
                alibi_slopes=None, sliding_window=self.sliding_window, block_table=block_table,
                softcap=self.logits_soft_cap, scheduler_metadata=schedule, s_aux=self.sinks,
                k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
                kv_cache_dtype=self.kv_cache_dtype,
            )  # fmt: skip
            output[new_rows] = o.view(output[new_rows].shape)
        # Every row's K/V back in its own slot.
        self._cache_write(layer, key[s:e], value[s:e], key_cache, value_cache, md.slot_mapping[s:e])


class TreeCPUAttentionBackend(CPUAttentionBackend):
    """CPU_ATTN with tree verification. get_name() stays "CPU_ATTN" (vLLM maps the
    name back to its enum)."""

    @staticmethod
    def get_impl_cls():
        return TreeCPUAttentionImpl


def rewrite_accepted_kv(layers: dict, ctx: TreeAttentionContext, moves) -> None:
    """Write each accepted path's K/V into the slots right after its root.
    moves: (tree rows, accepted path) pairs whose path is not already rows 1..k."""
    src, dst = [], []
    for tree, path in moves:
        src += [ctx.row_of(tree, node) for node in path]
        dst += [ctx.row_of(tree, j) for j in range(1, len(path) + 1)]
    if not src:
        return
    for name, (keys, values, slots) in ctx.captured.items():
        layer = layers[name]
        index = torch.tensor(src, device=keys.device)
        dst_slots = slots[torch.tensor(dst, device=slots.device)]
        layer.impl.do_kv_cache_update(layer, keys[index], values[index], layer.kv_cache, dst_slots)
