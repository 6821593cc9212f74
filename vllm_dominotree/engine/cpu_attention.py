"""Tree verification on CPU (the CPU_ATTN backend, vLLM 0.32).

After the stock kernel has run, each root-to-leaf path of a branching tree is recomputed
with the same kernel, causally, after temporarily writing the path's K/V into the slots
start .. start + depth; the canonical slots are restored at the end. Reusing the kernel
keeps every ISA-specific cache layout, sliding window and soft cap it supports; the cost
is one kernel call per leaf. What the calls need besides the layer's own tensors (row
indices, slots, lengths, the kernel's schedule) is the same for every layer of a step,
so it is built once per step (`_PathCall`).

The CPU cache layout depends on the ISA, so accepted paths are not moved slot to slot
inside it: the backend keeps a copy of the step's K/V rows per layer (`captured_kv`),
which commit.py rewrites into the path's new slots with the backend's own writer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from .backend_support import CPU_LACKS, check_supported
from .commit import captured_kv
from .tree_step import PAD_PARENT, TreeRows, installed


def _leaf_paths(parents: list[int]) -> list[tuple[list[int], int]]:
    """Root-to-leaf row paths, each with the index of its first row not already
    computed by an earlier path (only those rows' outputs are written)."""
    n = len(parents)
    has_child = [False] * n
    for p in parents[1:]:
        if p >= 0:
            has_child[p] = True
    done = [False] * n
    out = []
    for leaf in range(n):
        # Padding rows are never accepted: their causal output is left as it is.
        if has_child[leaf] or parents[leaf] == PAD_PARENT:
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


@dataclass
class _PathCall:
    """One root-to-leaf path's kernel call, for every layer of a step."""

    rows: torch.Tensor  # [depth] batch rows of the path, root first
    slots: torch.Tensor  # [depth] the slots start .. start + depth - 1
    new_rows: torch.Tensor  # the path's rows not computed by an earlier path
    query_start: torch.Tensor  # [0, len(new_rows)]
    seq_len: torch.Tensor  # [start + depth]
    schedule: torch.Tensor


# The kernel calls of the current step's paths (step, then per geometry and tree).
_path_calls: dict = {"step": None}


class TreeCPUAttentionImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, **kwargs):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, **kwargs)
        verification = installed()
        step = verification.step if verification is not None else None
        if step is None or attn_metadata is None or layer.layer_name not in verification.layers:
            return out
        check_supported(self, CPU_LACKS, "CPU")
        rows = step.num_tokens
        captured_kv[layer.layer_name] = (key[:rows].clone(), value[:rows].clone())
        if _path_calls["step"] is not step:
            _path_calls.clear()
            _path_calls["step"] = step
        for tree in step.branching:
            self._tree_rows_by_paths(
                layer, query, key, value, kv_cache, attn_metadata, output, tree
            )
        return out

    def _cache_write(self, layer, key, value, key_cache, value_cache, slots) -> None:
        ops.cpu_attn_reshape_and_cache(
            key,
            value,
            key_cache,
            value_cache,
            slots,
            layer.isa,
            k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype,
        )

    def _calls(self, layer, md, tree: TreeRows, dtype: torch.dtype) -> list[_PathCall]:
        s = tree.token_row
        calls = []
        for path, first_new in _leaf_paths(tree.parents):
            rows = torch.tensor(path, dtype=torch.long) + s
            depth = len(path)
            new_rows = rows[first_new:]
            seq_len = torch.tensor([tree.start + depth], dtype=torch.int32)
            query_start = torch.tensor([0, len(new_rows)], dtype=torch.int32)
            schedule = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=1,
                num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_size,
                seq_lens=seq_len,
                dtype=dtype,
                query_start_loc=query_start,
                causal=True,
                sliding_window_size=self.sliding_window,
                isa=layer.isa,
                enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
                kv_cache_dtype=self.kv_cache_dtype,
            )
            slots = md.slot_mapping[s : s + depth].contiguous()
            calls.append(_PathCall(rows, slots, new_rows, query_start, seq_len, schedule))
        return calls

    def _tree_rows_by_paths(self, layer, query, key, value, kv_cache, md, output, tree):
        num_blocks, heads, block_size, _ = kv_cache.shape
        key_cache, value_cache = kv_cache.view(num_blocks, heads, 2 * block_size, -1).chunk(2, 2)
        s, e = tree.token_row, tree.token_row + tree.num_rows
        block_table = md.block_table[tree.batch_index : tree.batch_index + 1]
        # Layers of one model share the geometry and the step's slot mapping.
        cache_key = (tree.token_row, self.num_heads, self.head_size, layer.isa)
        calls = _path_calls.get(cache_key)
        if calls is None:
            calls = _path_calls[cache_key] = self._calls(layer, md, tree, query.dtype)
        for call in calls:
            self._cache_write(
                layer, key[call.rows], value[call.rows], key_cache, value_cache, call.slots
            )
            q = query[call.new_rows]
            o = torch.empty_like(q)
            ops.cpu_attention_with_kv_cache(
                query=q,
                key_cache=key_cache,
                value_cache=value_cache,
                output=o,
                query_start_loc=call.query_start,
                seq_lens=call.seq_len,
                scale=self.scale,
                causal=True,
                alibi_slopes=None,
                sliding_window=self.sliding_window,
                block_table=block_table,
                softcap=self.logits_soft_cap,
                scheduler_metadata=call.schedule,
                s_aux=self.sinks,
                k_scale=layer._k_scale_float,
                v_scale=layer._v_scale_float,
                kv_cache_dtype=self.kv_cache_dtype,
            )
            output[call.new_rows] = o.view(output[call.new_rows].shape)
        # Every row's K/V back in its own slot.
        self._cache_write(layer, key[s:e], value[s:e], key_cache, value_cache, md.slot_mapping[s:e])


class TreeCPUAttentionBackend(CPUAttentionBackend):
    """CPU_ATTN with tree verification. get_name() stays "CPU_ATTN" (vLLM maps the
    name back to its enum)."""

    @staticmethod
    def get_impl_cls():
        return TreeCPUAttentionImpl
