"""Tree verification on CUDA: vLLM's FlashAttention and Triton backends plus a second
pass for the tree rows.

The stock kernel runs every row causally, which is exactly right for the rows whose
ancestors are all the rows before them (roots, chains); then, for the target's layers,
the other tree rows are recomputed with ancestor-only attention from the same paged
cache, by one of (DOMINOTREE_CUDA_TREE_ATTENTION, config.attention_mode):
- one-pass (the default where the target runs FA3): a step whose requests are all
  trees runs no stock pass in the target's layers: FA3 runs once per layer over the
  step's root-to-leaf path requests, which hold every row (engine/tree_paths.py), so
  that tree rows round exactly as decoding's rows do (in bf16 the fix-up's own rounding
  flips a small model's near-ties); other steps run as paths, and the runner keeps them
  out of FULL graphs; one-pass-fixup: the same with the fix-up's kernel for every row;
  one-pass-merge: the same steps with FA3 once per layer over each request's prefix
  alone and a Triton kernel for the trees' own rows, merged (kernels/tree_merge.py);
- paths: the stock pass, then FA3 once more over the path requests for the rows it got
  wrong;
- fixup (the default elsewhere: float32 models, vLLM's Triton backend): the Triton tree
  kernel (kernels/tree_attention.py), which reads each request's prefix once; beside
  vLLM's Triton attention it takes that kernel's key tiles and softmax steps, unsplit,
  so that its rows round as that kernel's (and decoding's) rows do; beside FA3 it takes
  FA3's blocks, splits and softmax steps for each row's own path
  (kernels/tree_attention_fa3.py).
Both read only device buffers (the attention metadata and the published step,
engine/tree_step.py), so a forward captured in a FULL CUDA graph replays them for every
step (the runner marks graph capture, whose warm-ups compile and whose captures record
the launch); in eager or piecewise execution a step whose trees need no fix skips the
second pass. Both backends keep K/V as [blocks, kv heads, slots, 2 * head dim], read
through a [blocks, slots, kv heads, head dim] view.
"""

from __future__ import annotations

import torch
from vllm.utils.torch_utils import canonicalize_singleton_dim_strides
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl

from ..kernels.tree_attention import TreeAttention
from ..kernels.tree_merge import merge_tree_part
from .attention_check import CHECK
from .backend_support import TREE_LACKS, check_supported
from .tree_paths import PathTables, slot_view, stream_capturing
from .tree_step import installed

_KERNELS: dict[tuple, TreeAttention] = {}  # one per geometry: its buffers' addresses stay

# FA3 on Hopper runs one MMA warpgroup on 64-row query tiles when max_seqlen_q x query
# heads per KV head <= 64 (hopper/heuristics.h, use_one_mma_wg; head dim 64 or 128), else
# two warpgroups on 128-row tiles. A path request holds a few rows (1 or 2 in a star),
# so told the tree's 17 rows FA3 takes the 128-row tiles, mostly padding, one per path
# and KV head. Its varlen scheduler on Hopper is always "prepared"
# (flash_prepare_scheduler.cu): it counts each request's row tiles from cu_seqlens_q, so
# a path longer than the bound still gets every row (in two tiles). Unsplit, a row's
# arithmetic is the same in either kernel (the warpgroup that holds it, 128-key blocks);
# FA3 sizes a request's key split from the step's row tiles x key blocks, so a step with
# paths of more than 64 / group rows (a chain of 17) may split differently.
FA3_ONE_WARPGROUP_ROWS = 64


class TreeFixupMixin:
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, **kwargs):
        verification = installed()
        tree_layer = (
            verification is not None
            and attn_metadata is not None
            and layer.layer_name in verification.layers
        )
        # One pass: the path requests or the fix-up compute every row, and the stock pass
        # is not run (the KV cache is already written: vLLM's do_kv_cache_update runs
        # before attention).
        one_pass = tree_layer and stock_pass_skipped(verification, attn_metadata, query.shape[0])
        if one_pass and verification.capturing:
            verification.one_pass_graphs.add(query.shape[0])
        if not one_pass:
            output = super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, **kwargs
            )
        if not tree_layer:
            return output
        step = verification.step
        if not (one_pass or verification.capturing or (step is not None and step.any_fix)):
            return output
        check_supported(self, TREE_LACKS, "CUDA")
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        rows = output.view(output.shape[0], self.num_heads, self.head_size)
        buffers = verification.buffers
        if one_pass and verification.merge:
            self.merge_tree_rows(
                query, key, value, key_cache, value_cache, verification, attn_metadata, rows
            )
        elif verification.paths is not None:
            self.recompute_paths(
                query, key_cache, value_cache, verification, attn_metadata, rows, one_pass
            )
        else:
            geometry = (self.num_heads, self.head_size, verification.rows_per_tree, query.device)
            rounds_as = fixup_rounding(self)
            kernel = _KERNELS.get((*geometry, rounds_as))
            if kernel is None:
                kernel = TreeAttention(*geometry, rounds_as=rounds_as)
                _KERNELS[(*geometry, rounds_as)] = kernel
            fix = verification.all_rows if one_pass else None
            kernel(
                query, key_cache, value_cache, *self.described(attn_metadata, buffers, fix), rows
            )
        if verification.check:
            # One pass computed every row: check them all against the reference.
            fix = verification.all_rows if one_pass else None
            checked = self.described(attn_metadata, buffers, fix)
            CHECK.record(layer.layer_name, query, key_cache, value_cache, *checked, rows)
        return output

    def described(self, attn_metadata, buffers, needs_fix=None) -> tuple:
        """The tree kernel's and the reference's step description: the batch's paged
        layout, each row's ancestors and which rows need a fix, the softmax scale."""
        return (
            attn_metadata.block_table,
            attn_metadata.query_start_loc,
            attn_metadata.seq_lens,
            buffers.token_ancestors,
            buffers.token_needs_fix if needs_fix is None else needs_fix,
            self.scale,
        )


def fixup_rounding(impl) -> str:
    """How the fix-up's rows round (kernels/tree_attention.py): as the target's own
    attention rounds decoding where the kernel knows how, vLLM's Triton backend
    ("triton") or FA3 up to head dim 128 ("fa3"), else its own way ("fast")."""
    if isinstance(impl, TritonAttentionImpl):
        return "triton"
    if (
        isinstance(impl, FlashAttentionImpl)
        and impl.vllm_flash_attn_version == 3
        and impl.head_size <= 128
    ):
        return "fa3"
    return "fast"


def stock_pass_skipped(verification, attn_metadata, num_tokens: int) -> bool:
    """One pass (DOMINOTREE_CUDA_TREE_ATTENTION=one-pass, one-pass-fixup): this forward's
    target layers skip the stock pass, every row recomputed. Eager or piecewise: when
    this step's requests are all trees (the runner's `every_row`). Captured: in the FULL
    graphs that vLLM replays only for such steps (`full_graph_of_trees_alone`); other
    graphs keep the stock pass (path tables that hold every row then recompute every row
    over it)."""
    if not verification.one_pass:
        return False
    if verification.capturing:
        return full_graph_of_trees_alone(verification.rows_per_tree, attn_metadata, num_tokens)
    return verification.every_row


def full_graph_of_trees_alone(rows_per_tree: int, attn_metadata, num_tokens: int) -> bool:
    """Whether the forward being captured is a FULL graph that is replayed only for steps
    whose requests are all trees.
    V1 captures FULL graphs in a FULL forward context; those of uniform batches qualify
    (the tree runner makes a step that is not all trees non-uniform:
    runner._determine_batch_execution_and_padding).
    V2 captures them in a forward context of mode NONE while the stream captures
    (cudagraph_utils.CudaGraphManager.capture); its uniform decode graphs, every request
    1 + budget rows, qualify: V2 replays them only for batches of that many rows per
    request and no prefill (model_runner.gather_batch_req_state), and every request with
    drafts is a tree. The V2 runner takes one pass only where vLLM captures no FULL graph
    of mixed batches (FULL_AND_PIECEWISE), whose metadata could look the same."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context

    context = get_forward_context()
    if context.cudagraph_runtime_mode == CUDAGraphMode.FULL:  # V1
        batch = context.batch_descriptor
        return batch is not None and batch.uniform
    if context.cudagraph_runtime_mode != CUDAGraphMode.NONE:
        return False
    if not torch.cuda.is_current_stream_capturing():  # a warm-up run
        return False
    num_reqs = attn_metadata.seq_lens.shape[0]
    return attn_metadata.max_query_len == rows_per_tree and num_tokens == rows_per_tree * num_reqs


def attend_paths(
    query: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,  # [blocks, page, KVH, D]
    value_cache: torch.Tensor,
    tables: PathTables,
    scale: float,
    max_query_len: int,
    max_seqlen_k: int,
    rows: torch.Tensor,  # [T, H, D]: the owned rows are overwritten
    fa_version: int = 3,
    num_splits: int = 0,
    varlen=None,
    every_row: bool = False,
    schedule: torch.Tensor | None = None,
) -> None:
    """The path requests' rows through FA3 (pages of one slot), written into `rows`.
    max_seqlen_k, num_splits: as the stock pass is called (no path request is longer
    than its request). FA3 reads each request's true key count from seqused_k; the two
    only steer its host-side choices (split count, GQA packing), which a captured graph
    keeps. varlen: vLLM's flash_attn_varlen_func (default), or a stand-in with its
    arguments (the CPU tests'). every_row (one pass): the tables own every real row, in
    the forward's order, since a step's trees come in depth-first preorder
    (tree/ancestry.in_preorder): FA3 reads the queries and writes the rows in place,
    no gather either way (padding rows of a graph are left alone, as vLLM's own FA3
    call leaves them). schedule: FA3's scheduler metadata for this call
    (schedule_paths with the same arguments; None: FA3 computes its own)."""
    if varlen is None:
        from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func as varlen

    num_tokens = query.shape[0]
    if every_row:
        path_query, path_out = query, rows
    else:
        # FA3 keeps float32 partials of [splits, heads, its queries, D], and outside a
        # graph its split heuristic for a varlen batch assumes one long sequence (16 or
        # more splits at 2k keys): given a mixed step's thousands of prefill rows as
        # queries it asked for 3.47 GiB (H100, 2026-12-06d). So outside a capture it gets
        # the trees' rows at most (the owned rows come first); a captured graph (a
        # uniform step of trees) keeps its every row.
        queries = num_tokens if stream_capturing() else min(num_tokens, tables.query_bound)
        if not queries:
            # Cleared tables (a forward without trees: the engine's memory profiling run)
            # own no row; the gather below would index an empty output (H100,
            # 2026-12-06f: round_cost_bench's tree engines failed to start).
            return
        path_query = query[tables.query_rows[:queries]]  # [Q, H, D]: owned rows first
        path_out = torch.empty_like(path_query)
    paths = path_batch_size(tables, num_tokens)
    varlen(
        q=path_query,
        k=slot_view(key_cache),
        v=slot_view(value_cache),
        out=path_out,
        cu_seqlens_q=tables.query_start[: paths + 1],
        max_seqlen_q=path_query_bound(
            max_query_len, query.shape[1], key_cache.shape[2], fa_version
        ),
        seqused_k=tables.seq_used[:paths],
        max_seqlen_k=max_seqlen_k,
        softmax_scale=scale,
        causal=True,
        block_table=tables.slot_table[:paths],
        fa_version=fa_version,
        num_splits=num_splits,
        scheduler_metadata=schedule,
    )
    if every_row:
        return
    # Into `rows`: a gather and a `where` keeping the stock pass's rows that no path
    # request owns.
    to_query = tables.row_to_query[:num_tokens]
    owned = tables.row_owned[:num_tokens, None, None]
    torch.where(owned, path_out[to_query], rows, out=rows)


def path_query_bound(rows_per_tree: int, num_heads: int, num_kv_heads: int, fa_version: int) -> int:
    """The max_seqlen_q FA3 is told for the path requests: the tree's rows, or fewer so
    that FA3 (version 3) takes its one-warpgroup kernel (FA3_ONE_WARPGROUP_ROWS)."""
    if fa_version != 3:
        return rows_per_tree
    group = num_heads // num_kv_heads
    return max(1, min(rows_per_tree, FA3_ONE_WARPGROUP_ROWS // group))


def path_batch_size(tables: PathTables, num_tokens: int) -> int:
    """FA3's batch for a forward of num_tokens rows: every path request owns a forward
    row, and the tables keep them first, so this forward's rows at most (static under a
    graph), not the tables' capacity."""
    return min(num_tokens, tables.seq_used.shape[0])


def schedule_paths(
    tables: PathTables,
    num_tokens: int,
    num_heads: int,
    key_cache: torch.Tensor,  # [blocks, page, KVH, D]
    max_query_len: int,
    max_seqlen_k: int,
    num_splits: int,
    scheduler=None,
) -> torch.Tensor:
    """FA3's scheduler metadata (per-request block counts and split counts, the tile
    semaphore) for attend_paths' call with the same arguments. FA3 computes it in every
    call unless given; the path requests are the same in every layer of a forward, so the
    first layer computes it once for all (vLLM's backend does the same for the stock pass,
    get_scheduler_metadata in its metadata builder). scheduler: vLLM's
    get_scheduler_metadata (default) or a stand-in."""
    if scheduler is None:
        from vllm.v1.attention.backends.fa_utils import get_scheduler_metadata as scheduler

    paths = path_batch_size(tables, num_tokens)
    return scheduler(
        batch_size=paths,
        max_seqlen_q=path_query_bound(max_query_len, num_heads, key_cache.shape[2], 3),
        max_seqlen_k=max_seqlen_k,
        num_heads_q=num_heads,
        num_heads_kv=key_cache.shape[2],
        headdim=key_cache.shape[3],
        cache_seqlens=tables.seq_used[:paths],
        qkv_dtype=key_cache.dtype,
        cu_seqlens_q=tables.query_start[: paths + 1],
        page_size=1,
        causal=True,
        num_splits=num_splits,
    )


def attend_merged(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, KVH, D]: this forward's keys, as written to the cache
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [blocks, page, KVH, D]
    value_cache: torch.Tensor,
    *,
    block_table: torch.Tensor,  # [B, pages]
    query_start: torch.Tensor,  # [B + 1]
    prefix_lens: torch.Tensor,  # [B] int32: each request's keys before its root
    max_query_len: int,
    max_seqlen_k: int,
    ancestors: torch.Tensor,  # [>= T] per row (engine/tree_step.py)
    offset: torch.Tensor,  # [>= T] per row: its offset from its tree's root
    scale: float,
    rows: torch.Tensor,  # [T, H, D]: every row written
    fa_version: int = 3,
    num_splits: int = 0,
    varlen=None,
) -> None:
    """Every row of an all-tree step (one-pass-merge): FA3 over each request's prefix
    alone, every row of the request a query of it (non-causal: the prefix is read once
    per request), then each row's own tree rows and the merge by log-sum-exp
    (kernels/tree_merge.py). varlen: vLLM's flash_attn_varlen_func (default), or a
    stand-in with its arguments (the CPU tests')."""
    if varlen is None:
        from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func as varlen

    prefix_out = torch.empty_like(query)
    _, prefix_lse = varlen(
        q=query,
        k=key_cache,
        v=value_cache,
        out=prefix_out,
        cu_seqlens_q=query_start,
        max_seqlen_q=max_query_len,
        seqused_k=prefix_lens,
        max_seqlen_k=max_seqlen_k,
        softmax_scale=scale,
        causal=False,
        block_table=block_table,
        return_softmax_lse=True,
        fa_version=fa_version,
        num_splits=num_splits,
    )
    merge_tree_part(query, key, value, prefix_out, prefix_lse, ancestors, offset, scale, rows)


class TreeFlashAttentionImpl(TreeFixupMixin, FlashAttentionImpl):
    def merge_tree_rows(
        self, query, key, value, key_cache, value_cache, verification, attn_metadata, rows
    ):
        """Every row of an all-tree step as FA3 over the prefixes plus the trees' own
        part (attend_merged), FA3 called with the stock pass's split bound."""
        num_tokens = query.shape[0]
        attend_merged(
            query,
            key[:num_tokens],
            value[:num_tokens],
            canonicalize_singleton_dim_strides(key_cache),
            canonicalize_singleton_dim_strides(value_cache),
            block_table=attn_metadata.block_table,
            query_start=attn_metadata.query_start_loc,
            prefix_lens=verification.prefix_lens[: attn_metadata.seq_lens.shape[0]],
            max_query_len=verification.rows_per_tree,
            max_seqlen_k=attn_metadata.max_seq_len,
            ancestors=verification.buffers.token_ancestors,
            offset=verification.buffers.token_offset,
            scale=self.scale,
            rows=rows,
            fa_version=self.vllm_flash_attn_version,
            num_splits=attn_metadata.max_num_splits,
        )

    def recompute_paths(
        self, query, key_cache, value_cache, verification, attn_metadata, rows, every_row
    ):
        """The fixed rows once more through FA3, as the queries of the step's path
        requests (tree_paths.py), written over the stock pass's rows (every_row: one
        pass, every row and no stock pass). FA3 is called as
        the stock pass is (the step's longest sequence, vLLM's split bound) unless
        DOMINOTREE_PATH_SPLITS sets the split count; what the pass costs under each
        setting: benchmarks/tree_rounding_bench.py."""
        tables = verification.paths
        splits = attn_metadata.max_num_splits if tables.splits is None else tables.splits
        schedule = tables.schedule_of(
            attn_metadata,
            lambda: schedule_paths(
                tables,
                query.shape[0],
                query.shape[1],
                key_cache,
                verification.rows_per_tree,
                attn_metadata.max_seq_len,
                splits,
            ),
        )
        attend_paths(
            query,
            key_cache,
            value_cache,
            tables,
            self.scale,
            verification.rows_per_tree,
            attn_metadata.max_seq_len,
            rows,
            self.vllm_flash_attn_version,
            splits,
            every_row=every_row,
            schedule=schedule,
        )


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
