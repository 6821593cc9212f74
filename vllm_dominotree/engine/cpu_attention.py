"""Tree verification on CPU (the CPU_ATTN backend, vLLM 0.32).

vLLM writes every row's K/V into its linear slot before attention. Its kernel then runs
over every row, causally: right for the roots, for chains and for every row outside
trees. The rows whose ancestor set is not their causal prefix (`needs_fix`) are computed
again by the same kernel, over path requests: one per root-to-leaf path that holds such
rows, its sequence the request's prefix followed by the path's rows (root first), so the
kernel's causal attention over it is the ancestor-only attention of the path's rows. A
path request's queries are its fixed rows that no earlier path took: a suffix of the
path, since a fixed row's descendants are fixed and two paths share a prefix.

A step whose requests are all trees, some row to fix (the runner's `every_row`: single
requests decoding, the usual CPU step), skips vLLM's pass: its path requests take every
row, each once (the rows no earlier path took: again a suffix). vLLM's pass cost about
30 us a layer there, as much as the path requests' kernel call (the shipped SmolLM2
pair, budget 4, bf16, a 2-core AMD EPYC, 2026-12-07).

The kernel reads one cache tensor, so per layer the path requests run on a scratch copy
of the blocks they read (whole blocks, so the cache's layout, which differs between
ISAs, never matters): each request's blocks before its tree's first block once, and per
path its own copies of the blocks from there on, where vLLM's writer puts the path's K/V
at the path's positions. What the path requests need besides the layer's tensors is the
same for every layer of a step and is built once per step (`PathBatch`).

Accepted paths are not moved slot to slot inside the ISA's layout either: the backend
keeps a copy of the step's K/V rows per layer (`captured_kv`), which commit.py rewrites
into the path's new slots with the backend's own writer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from .backend_support import TREE_LACKS, check_supported
from .commit import captured_kv
from .tree_paths import split_into_paths
from .tree_step import TreeRows, installed


def write_cache(
    kv_cache: torch.Tensor,  # [num_blocks, kv_heads, block_size, 2 * D]
    isa: str,
    keys: torch.Tensor,  # [T, kv_heads, D]
    values: torch.Tensor,  # [T, kv_heads, D]
    slots: torch.Tensor,  # [T]
) -> None:
    """vLLM's CPU cache writer on a layer's raw cache (unquantized)."""
    num_blocks, heads, block_size, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(num_blocks, heads, 2 * block_size, -1).chunk(2, 2)
    ops.cpu_attn_reshape_and_cache(
        keys, values, key_cache, value_cache, slots, isa, 1.0, 1.0, kv_cache_dtype="auto"
    )


@dataclass
class PathBatch:
    """A step's recomputed rows as path requests of vLLM's kernel, the same for every
    layer of the step (per KV cache group)."""

    source_blocks: torch.Tensor  # [m] int64: scratch block i copies cache block source_blocks[i]
    block_table: torch.Tensor  # [P, max_blocks] int32, into the scratch
    seq_lens: torch.Tensor  # [P] int32
    query_start_loc: torch.Tensor  # [P + 1] int32
    query_rows: torch.Tensor  # [Q] int64: forward rows whose output is replaced
    kv_rows: torch.Tensor  # [W] int64: forward rows whose K/V the scratch takes ...
    kv_slots: torch.Tensor  # [W] int64: ... at these slots of the scratch
    _schedules: dict = field(default_factory=dict)  # the kernel's plan, per layer geometry

    def schedule(self, impl: CPUAttentionBackendImpl, isa: str, dtype: torch.dtype):
        key = (impl.num_heads, impl.num_kv_heads, impl.head_size, isa, dtype)
        if key not in self._schedules:
            self._schedules[key] = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=len(self.seq_lens),
                num_heads=impl.num_heads,
                num_kv_heads=impl.num_kv_heads,
                head_dim=impl.head_size,
                seq_lens=self.seq_lens,
                dtype=dtype,
                query_start_loc=self.query_start_loc,
                causal=True,
                sliding_window_size=-1,
                isa=isa,
                enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
                kv_cache_dtype=impl.kv_cache_dtype,
            )
        return self._schedules[key]


def path_batch(
    trees: list[tuple[TreeRows, np.ndarray, np.ndarray, torch.Tensor]],
    block_size: int,
    every_row: bool = False,
) -> PathBatch | None:
    """trees: per tree (its rows, needs_fix [n] bool, ancestor bits [n] int64 as in
    tree_step.py: bit j - 1 is row j, the root implied, and the request's block table
    row). The path requests' queries are the rows that need fixing, or with `every_row`
    every row. None when no row is wanted."""
    sources: list[int] = []
    tables: list[list[int]] = []
    seq_lens: list[int] = []
    query_rows: list[int] = []
    query_starts = [0]
    kv_rows: list[int] = []
    kv_slots: list[int] = []
    for tree, needs_fix, ancestors, block_table in trees:
        splits = split_into_paths(ancestors, needs_fix, every_row)
        if not splits:
            continue
        start = tree.start
        first_block = start // block_size  # the block holding the root's position
        table = block_table.tolist()
        shared = list(range(len(sources), len(sources) + first_block))
        sources += table[:first_block]
        for path, owned in splits:
            rows = [0, *path]  # the root, then depth 1 .. the leaf
            length = start + len(rows)
            own = list(
                range(len(sources), len(sources) + (length - 1) // block_size + 1 - first_block)
            )
            sources += table[first_block : first_block + len(own)]
            scratch = shared + own
            for i, row in enumerate(path, 1):
                position = start + i
                kv_rows.append(tree.token_row + row)
                kv_slots.append(
                    scratch[position // block_size] * block_size + position % block_size
                )
            tables.append(scratch)
            seq_lens.append(length)
            query_rows += [tree.token_row + r for r in rows[len(rows) - owned :]]
            query_starts.append(len(query_rows))
    if not tables:
        return None
    width = max(map(len, tables))
    padded = [t + [0] * (width - len(t)) for t in tables]
    return PathBatch(
        torch.tensor(sources, dtype=torch.int64),
        torch.tensor(padded, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        torch.tensor(query_starts, dtype=torch.int32),
        torch.tensor(query_rows, dtype=torch.int64),
        torch.tensor(kv_rows, dtype=torch.int64),
        torch.tensor(kv_slots, dtype=torch.int64),
    )


def recompute_rows(
    impl: CPUAttentionBackendImpl,
    isa: str,
    query: torch.Tensor,  # [tokens, heads, D]
    key: torch.Tensor,  # [tokens, kv_heads, D]
    value: torch.Tensor,  # [tokens, kv_heads, D]
    kv_cache: torch.Tensor,  # [num_blocks, kv_heads, block_size, 2 * D], rows written
    output: torch.Tensor,  # [tokens, heads * D] or [tokens, heads, D]
    paths: PathBatch,
) -> None:
    """Overwrite the fixed rows' outputs with vLLM's kernel over the path requests."""
    scratch = kv_cache.index_select(0, paths.source_blocks)
    write_cache(scratch, isa, key[paths.kv_rows], value[paths.kv_rows], paths.kv_slots)
    blocks, kv_heads, block_size, _ = scratch.shape
    key_cache, value_cache = scratch.view(blocks, kv_heads, 2 * block_size, -1).chunk(2, 2)
    queries = query[paths.query_rows]
    out = torch.empty_like(queries)
    ops.cpu_attention_with_kv_cache(
        query=queries,
        key_cache=key_cache,
        value_cache=value_cache,
        output=out,
        query_start_loc=paths.query_start_loc,
        seq_lens=paths.seq_lens,
        scale=impl.scale,
        causal=True,
        alibi_slopes=None,
        sliding_window=-1,
        block_table=paths.block_table,
        softcap=0.0,
        scheduler_metadata=paths.schedule(impl, isa, query.dtype),
        s_aux=None,
    )
    output.view(output.shape[0], *queries.shape[1:])[paths.query_rows] = out


# The current step's path requests (step, then per attention metadata, i.e. per KV cache
# group).
_step_paths: dict = {"step": None}


class TreeCPUAttentionImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, **kwargs):
        verification = installed()
        step = verification.step if verification is not None else None
        if step is None or attn_metadata is None or layer.layer_name not in verification.layers:
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, **kwargs
            )
        check_supported(self, TREE_LACKS, "CPU")
        rows = step.num_tokens
        captured_kv[layer.layer_name] = (key[:rows].clone(), value[:rows].clone())
        one_pass = verification.every_row  # the runner's choice for this step
        if one_pass and attn_metadata.num_actual_tokens != rows:
            raise AssertionError(f"dominotree: one pass over {rows} tree rows, the forward has "
                                 f"{attn_metadata.num_actual_tokens}")  # fmt: skip
        if not one_pass:
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output, **kwargs)
            if not step.any_fix:
                return output
        paths = self._paths(verification, attn_metadata, kv_cache.shape[2], one_pass)
        if paths is not None:
            recompute_rows(self, layer.isa, query, key, value, kv_cache, output, paths)
        return output

    @staticmethod
    def _paths(verification, md, block_size: int, every_row: bool) -> PathBatch | None:
        """The step's path requests for the layers of md's KV cache group (the same for
        every layer of the step: built once)."""
        step = verification.step
        if _step_paths["step"] is not step:
            _step_paths.clear()
            _step_paths["step"] = step
        if id(md) not in _step_paths:
            needs_fix = verification.buffers.token_needs_fix.numpy().astype(bool)
            ancestors = verification.buffers.token_ancestors.numpy()
            trees = []
            for t in step.trees:
                rows = slice(t.token_row, t.token_row + t.num_rows)
                trees.append((t, needs_fix[rows], ancestors[rows], md.block_table[t.batch_index]))
            _step_paths[id(md)] = path_batch(trees, block_size, every_row)
        return _step_paths[id(md)]


class TreeCPUAttentionBackend(CPUAttentionBackend):
    """CPU_ATTN with tree verification. get_name() stays "CPU_ATTN" (vLLM maps the
    name back to its enum)."""

    @staticmethod
    def get_impl_cls():
        return TreeCPUAttentionImpl
