"""Ancestor-only attention for draft-tree rows over a paged KV cache (Triton), graph-safe.

vLLM's kernel has already run every row causally over its request's linear order. That
is exactly right for a row whose ancestors are all the rows before it (a tree's root, a
chain's rows); every other tree row must see the committed prefix, its ancestors and
itself only, and this kernel recomputes those rows (`needs_fix`), leaving every other
row's output bit for bit as the stock kernel wrote it.

Everything a launch reads is on the device: the attention metadata's query_start_loc /
seq_lens / block table, and the step's per-row ancestor bits and needs_fix flags
(engine/tree_step.py), so a launch captured in a CUDA graph recomputes the right rows at
every replay. The grid depends only on the batch's shape: one program per (request,
KV head, key split); a request whose rows need no fix returns at once. With more than
one split (small batches, to fill the GPU), each split stores its partial result and the
last of a (request, KV head)'s splits to finish merges them by log-sum-exp, in the same
launch (a per-(request, KV head) counter, reset by the merging program for the next
launch or graph replay): one launch per layer.

Layout: key_cache / value_cache index as [block, slot in block, kv head, head dim]
(vLLM's FlashAttention / Triton backends; any strides). A request's rows are the query
rows query_start[r] .. query_start[r + 1] - 1 at positions seq_len - rows .. seq_len - 1;
its tree (if any) starts at its first row. Row j >= 1 of a tree is visible to row i iff
bit j - 1 of i's ancestor bits is set; the root and the prefix are visible to all.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch
import triton
import triton.language as tl

FAST_KEY_TILE = 64  # keys per inner step, for speed (beside FA3: its rows round apart anyway)
# vLLM's Triton attention over rows of more than one query (its 2D kernel: every
# verification pass, and decoding beyond its 3D kernel's sequence threshold) takes keys in
# tiles of 32 for 16- and 32-bit caches, one program per request and KV head.
TRITON_KEY_TILE = 32
MAX_SPLITS = 16
LOG2E = 1.4426950408889634


@triton.jit
def _split_keys(seq_len, num_splits, KEY_TILE: tl.constexpr):
    """Keys per split (whole tiles); splits past the context's end hold none."""
    return tl.cdiv(tl.cdiv(seq_len, num_splits), KEY_TILE) * KEY_TILE


@triton.jit
def _merge_splits(
    PartAcc,
    PartMax,
    PartSum,
    Out,
    row,  # [M] query rows
    head,  # [M] their heads
    write,  # [M] the (row, head) pairs to merge
    used,  # the splits that held keys
    stride_ps,
    stride_pt,
    stride_ph,
    stride_ms,
    stride_mt,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
):
    """Log-sum-exp merge of the splits' partial results of (row, head) pairs."""
    dims = tl.arange(0, HEAD_DIM)
    stat = row * stride_mt + head
    best = tl.full(row.shape, float("-inf"), tl.float32)
    for s in range(0, used):
        part = tl.load(PartMax + s * stride_ms + stat, mask=write, other=float("-inf"))
        best = tl.maximum(best, part)
    best = tl.where(write, best, 0.0)  # every fixed row saw its root: best is finite
    total = tl.zeros(row.shape, tl.float32)
    acc = tl.zeros([row.shape[0], HEAD_DIM], tl.float32)
    for s in range(0, used):
        weight = tl.exp(
            tl.load(PartMax + s * stride_ms + stat, mask=write, other=float("-inf")) - best
        )
        total += weight * tl.load(PartSum + s * stride_ms + stat, mask=write, other=0.0)
        part = tl.load(
            PartAcc
            + s * stride_ps
            + row[:, None] * stride_pt
            + head[:, None] * stride_ph
            + dims[None, :],
            mask=write[:, None],
            other=0.0,
        )
        acc += weight[:, None] * part
    total = tl.where(write, total, 1.0)
    tl.store(
        Out + row[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
        (acc / total[:, None]).to(Out.dtype.element_ty),
        mask=write[:, None],
    )


@triton.jit
def _tree_rows_attention(
    Q,
    K,
    V,
    BlockTable,
    QueryStart,
    SeqLens,
    Ancestors,
    NeedsFix,
    PartAcc,
    PartMax,
    PartSum,
    Counters,
    Out,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_ms,
    stride_mt,
    scale,
    num_splits,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    ROWS: tl.constexpr,
    KEY_TILE: tl.constexpr,
    DIRECT: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    first_row = tl.load(QueryStart + req)
    num_rows = tl.load(QueryStart + req + 1) - first_row
    # Query tile: (row, head in group) pairs, M = ROWS * GROUP_PAD.
    m_idx = tl.arange(0, ROWS * GROUP_PAD)
    row = m_idx // GROUP_PAD
    group_head = m_idx % GROUP_PAD
    row_ok = row < num_rows
    fix = tl.load(NeedsFix + first_row + row, mask=row_ok, other=0) != 0
    if tl.max(fix.to(tl.int32), axis=0) == 0:
        return
    m_ok = row_ok & (group_head < GROUP)
    seq_len = tl.load(SeqLens + req)
    chunk = _split_keys(seq_len, num_splits, KEY_TILE)
    first_key = split * chunk
    if first_key >= seq_len:  # an empty split: the merge does not read it
        return
    start = seq_len - num_rows  # position of the request's first row (its tree's root)
    head = kv_head * GROUP + group_head
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        Q + (first_row + row)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=m_ok[:, None],
        other=0.0,
    )
    ancestors = tl.load(Ancestors + first_row + row, mask=m_ok, other=0)

    best = tl.full([ROWS * GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([ROWS * GROUP_PAD], tl.float32)
    acc = tl.zeros([ROWS * GROUP_PAD, HEAD_DIM], tl.float32)
    last_key = tl.minimum(first_key + chunk, seq_len)
    offsets = tl.arange(0, KEY_TILE)
    for tile in range(first_key, last_key, KEY_TILE):
        pos = tile + offsets
        key_ok = pos < last_key
        block = tl.load(BlockTable + req * stride_bt + pos // PAGE, mask=key_ok, other=0)
        slot = pos % PAGE
        k_ptr = K + block[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh
        v_ptr = V + block[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh
        k = tl.load(k_ptr + dims[None, :], mask=key_ok[:, None], other=0.0)
        v = tl.load(v_ptr + dims[None, :], mask=key_ok[:, None], other=0.0)
        tree_index = pos - start  # <= 0: the prefix or the root, seen by every row
        shift = tl.maximum(tree_index - 1, 0).to(tl.int64)
        bit = (ancestors[:, None] >> shift[None, :]) & 1
        visible = key_ok[None, :] & ((tree_index <= 0)[None, :] | (bit != 0))
        # Products at Triton's default precision, as vLLM's own Triton attention (float32
        # models' backend) computes them: TF32 for float32 inputs on CUDA, so the rows it
        # leaves and the rows fixed here round their inputs alike. (Until 2026-12-02 this
        # kernel multiplied in IEEE float32; with it a float32 SmolLM2-135M's greedy
        # output left the target's own on the H200.)
        scores = tl.dot(q, tl.trans(k)) * scale
        scores = tl.where(visible, scores, float("-inf"))
        # The online softmax step in the order vLLM's Triton attention takes it (its
        # unified kernel), so that with its tile size and one split a fixed row rounds
        # as that kernel's rows do. A row that has seen no visible key yet takes 0 as its
        # maximum (no inf - inf); its weights and sum stay 0.
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        new_best = tl.where(new_best > float("-inf"), new_best, 0.0)
        weights = tl.exp(scores - new_best[:, None])
        correction = tl.exp(best - new_best)
        total = total * correction + tl.sum(weights, axis=1)
        acc = acc * correction[:, None]
        acc += tl.dot(weights.to(v.dtype), v)
        best = new_best
    write = m_ok & fix
    if DIRECT:  # the only split: normalize and write the rows' output
        out = acc / total[:, None]
        tl.store(
            Out
            + (first_row + row)[:, None] * stride_ot
            + head[:, None] * stride_oh
            + dims[None, :],
            out.to(Out.dtype.element_ty),
            mask=write[:, None],
        )
    else:  # a row that saw no key of this split stores (-inf, 0, 0): weighed as nothing
        tl.store(
            PartAcc
            + split * stride_ps
            + (first_row + row)[:, None] * stride_pt
            + head[:, None] * stride_ph
            + dims[None, :],
            acc,
            mask=write[:, None],
        )
        tl.store(
            PartMax + split * stride_ms + (first_row + row) * stride_mt + head, best, mask=write
        )
        tl.store(
            PartSum + split * stride_ms + (first_row + row) * stride_mt + head, total, mask=write
        )
        # Every thread's stores are issued before the counter's release; the program
        # that counts last acquires them all and merges the splits that held keys.
        tl.debug_barrier()
        used = tl.cdiv(seq_len, chunk)
        counter = Counters + req * tl.num_programs(1) + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == used - 1:
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # for the next launch
            _merge_splits(
                PartAcc,
                PartMax,
                PartSum,
                Out,
                first_row + row,
                head,
                write,
                used,
                stride_ps,
                stride_pt,
                stride_ph,
                stride_ms,
                stride_mt,
                stride_ot,
                stride_oh,
                HEAD_DIM,
            )


def num_splits_for(
    num_reqs: int, kv_heads: int, num_rows: int, capacity_rows: int, like_triton: bool
) -> int:
    """Key splits per request: enough programs to fill the GPU at small batches, within
    the partial buffers (splits x rows <= capacity_rows); one when the rows must round
    as vLLM's Triton attention (which does not split verification rows) rounds them. A
    function of the batch's shape only, so it is fixed inside a captured graph."""
    if like_triton:
        return 1
    wanted = triton.cdiv(256, max(1, num_reqs * kv_heads))
    return max(1, min(MAX_SPLITS, wanted, capacity_rows // max(1, num_rows)))


ROUNDINGS = ("fast", "triton", "fa3")


def _io_strides(query, key_cache, value_cache, block_table, out) -> tuple[int, ...]:
    """The strides both kernels take after their tensors: query [T, H, D] (token, head),
    the key and value caches [blocks, page, KV heads, D] (block, slot, head), the block
    table (request), out [T, H, D] (token, head)."""
    return (
        *query.stride()[:2],
        *key_cache.stride()[:3],
        *value_cache.stride()[:3],
        block_table.stride(0),
        *out.stride()[:2],
    )


class TreeAttention:
    """The kernels with their partial-result buffers, allocated once per geometry (the
    addresses a captured graph keeps)."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        rows_per_tree: int,
        device,
        capacity_rows: int = 4096,
        rounds_as: str = "fast",
    ):
        """rounds_as: "triton", as vLLM's Triton attention rounds (its key tiles, no
        splits), for targets that run it; "fa3", as FA3 rounds decoding
        (tree_attention_fa3.py), for targets on FA3; "fast", key splits for speed and
        its own rounding."""
        if rounds_as not in ROUNDINGS:
            raise ValueError(f"rounds_as={rounds_as!r}; use one of {ROUNDINGS}")
        rows = triton.next_power_of_2(rows_per_tree)
        # The FA3 kernel takes tiles of 32 tree rows at least: with 16 or 8 (SmolLM2's
        # trees, a 64-row tile) its per-thread row sums came out wrong (SmolLM2 heads) or
        # read out of bounds (Qwen3-4B heads) on the H200's Triton 3.6, where 32 were
        # bit-exact to FA3 on the same trees (benchmarks/results/h200_2026-12-04c).
        self.rows_per_tree = max(32, rows) if rounds_as == "fa3" else rows
        # The FA3 kernel's window of key chunks that holds a tree: sized by the tree's
        # rows, not the tile's (32 keys for 17 rows where 64 spilled 1.5 KB more per
        # thread, ptxas for sm_90).
        self.fa3_window = triton.next_power_of_2(rows_per_tree + 15)
        self.capacity_rows = capacity_rows
        self.rounds_as = rounds_as
        self.key_tile = TRITON_KEY_TILE if rounds_as == "triton" else FAST_KEY_TILE
        if rounds_as == "fa3":  # FA3's partial results: a split's O and log-sum-exp
            from .tree_attention_fa3 import fa3_partial_rows

            partial_rows = fa3_partial_rows(capacity_rows)
            self.part_acc = torch.empty(partial_rows, num_heads, head_dim, device=device)
            self.part_max = torch.empty(partial_rows, num_heads, device=device)
        else:
            self.part_acc = torch.empty(capacity_rows, num_heads, head_dim, device=device)
            self.part_max = torch.empty(capacity_rows, num_heads, device=device)
            self.part_sum = torch.empty(capacity_rows, num_heads, device=device)
        # Splits finished per (request, KV head), zero between launches (with splits,
        # requests <= rows <= capacity_rows).
        self.counters = torch.zeros(capacity_rows * num_heads, device=device, dtype=torch.int32)
        # How the FA3-rounded kernel takes FA3's fast math (tree_attention_fa3.py): PTX's
        # approximate ex2 / rcp / lg2 on the GPU (1; 2 reads `1.f / sum` as div.full);
        # the interpreter runs no PTX (0: Triton's exp2, IEEE division). Row sums in
        # FA3's per-thread order, or tl.sum's.
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        self.fa3_math = 0 if interpreted or torch.device(device).type != "cuda" else 1
        self.fa3_thread_sums = True
        # Warps per program: 8 keeps its [rows x group, head dim] float32 accumulator and
        # [rows x group, key sub-tile] tiles with the fewest spills found for sm_90
        # (ptxas: 724 bytes per thread at head dim 128, 4,888 with 4 warps, 1,412 with 16
        # at 128 registers); fa3_exactness_bench.py times the others on the GPU.
        self.fa3_warps = 8
        # FA3's scheduler sizes its splits by the GPU's multiprocessors (H200: 132).
        device = torch.device(device)
        self.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 132
        )

    def __call__(
        self,
        query: torch.Tensor,  # [T, H, D]
        key_cache: torch.Tensor,  # [num_blocks, page, KVH, D]
        value_cache: torch.Tensor,  # [num_blocks, page, KVH, D]
        block_table: torch.Tensor,  # [R, max_blocks] int32
        query_start: torch.Tensor,  # [R + 1] int32
        seq_lens: torch.Tensor,  # [R] int32
        ancestors: torch.Tensor,  # [>= T] int64
        needs_fix: torch.Tensor,  # [>= T] int64
        scale: float,
        out: torch.Tensor,  # [T, H, D]: rows that need a fix are overwritten
        decode_batch_blocks: int = 0,
    ) -> None:
        """decode_batch_blocks ("fa3"): the key blocks of the decoding step whose
        rounding the rows take (FA3 sizes its splits by them); 0, the default: this
        step's requests decoding one row each."""
        num_tokens, heads, head_dim = query.shape
        if self.rounds_as == "fa3" and query.element_size() != 2:
            # FA3 runs 16-bit inputs only, and float32 tiles of FA3's key blocks exceed
            # the H200's shared memory (360 KB at head dim 128, 2026-12-04).
            raise ValueError(
                f"rounds_as='fa3' takes float16 / bfloat16 inputs (FA3's), got "
                f"{query.dtype}; use rounds_as='fast' or 'triton' for {query.dtype}"
            )
        num_reqs = seq_lens.shape[0]
        kv_heads, page = key_cache.shape[2], key_cache.shape[1]
        group = heads // kv_heads
        group_pad = triton.next_power_of_2(group)
        if self.rounds_as == "fa3":
            tensors = (query, key_cache, value_cache, block_table, query_start, seq_lens)
            tensors += (ancestors, needs_fix)
            self._launch_fa3(tensors, out, scale, group, group_pad, decode_batch_blocks)
            return
        splits = num_splits_for(
            num_reqs, kv_heads, num_tokens, self.capacity_rows, self.rounds_as == "triton"
        )
        direct = splits == 1
        view = (splits, 0 if direct else num_tokens)  # the direct path writes no partials
        used = view[0] * view[1]
        part_acc = self.part_acc[:used].view(*view, heads, head_dim)
        part_max = self.part_max[:used].view(*view, heads)
        part_sum = self.part_sum[:used].view(*view, heads)
        common = (
            query,
            key_cache,
            value_cache,
            block_table,
            query_start,
            seq_lens,
            ancestors,
            needs_fix,
            part_acc,
            part_max,
            part_sum,
            self.counters,
            out,
            *_io_strides(query, key_cache, value_cache, block_table, out),
            part_acc.stride(0),
            part_acc.stride(1),
            part_acc.stride(2),
            part_max.stride(0),
            part_max.stride(1),
        )
        tile = self.rows_per_tree * group_pad * head_dim
        shape = dict(
            GROUP=group,
            GROUP_PAD=group_pad,
            HEAD_DIM=head_dim,
            PAGE=page,
            ROWS=self.rows_per_tree,
            # A [rows x group, head dim] float32 accumulator: 8 warps keep a 128 x 128
            # one in registers (4 spill it).
            num_warps=8 if tile >= 128 * 128 else 4,
        )
        grid = (num_reqs, kv_heads, splits)
        _tree_rows_attention[grid](
            *common, scale, splits, KEY_TILE=self.key_tile, DIRECT=direct, **shape
        )

    def _launch_fa3(self, tensors, out, scale, group, group_pad, decode_batch_blocks) -> None:
        """The FA3-rounded kernel: a program per (request, KV head, FA3 split)."""
        from .tree_attention_fa3 import (
            FA3_KEY_SUB,
            FA3_SPLITS,
            fa3_block_n,
            tree_rows_attention_fa3,
        )

        query, key_cache, value_cache, block_table = tensors[:4]
        num_reqs, kv_heads = tensors[5].shape[0], key_cache.shape[2]
        head_dim = query.shape[2]
        block_n = fa3_block_n(head_dim)
        # FA3's host side: softmax_scale (a float) times log2(e), stored as a float.
        scale_log2 = float(np.float32(np.float32(scale) * LOG2E))
        lse_scale = float(np.float32(scale_log2) * np.float32(math.log(2)))
        tree_rows_attention_fa3[(num_reqs, kv_heads, FA3_SPLITS)](
            *tensors,
            self.part_acc,
            self.part_max,
            self.counters,
            out,
            *_io_strides(query, key_cache, value_cache, block_table, out),
            self.part_acc.stride(0),
            self.part_acc.stride(1),
            self.part_max.stride(0),
            scale_log2,
            lse_scale,
            self.num_sms,
            decode_batch_blocks,
            GROUP=group,
            GROUP_PAD=group_pad,
            HEAD_DIM=head_dim,
            PAGE=key_cache.shape[1],
            ROWS=self.rows_per_tree,
            WIN=self.fa3_window,
            BLOCK_N=block_n,
            SUB=FA3_KEY_SUB,
            NUM_SPLITS=FA3_SPLITS,
            MATH=self.fa3_math,
            THREAD_SUMS=self.fa3_thread_sums,
            num_warps=self.fa3_warps,
        )


def tree_attention_reference(
    query,
    key_cache,
    value_cache,
    block_table,
    query_start,
    seq_lens,
    ancestors,
    needs_fix,
    scale,
    out,
) -> None:
    """Dense torch version (gather the pages, masked softmax) of the rows that need a
    fix: the kernel's oracle."""
    group = query.shape[1] // key_cache.shape[2]
    page = key_cache.shape[1]
    for r in range(seq_lens.numel()):
        first, end = int(query_start[r]), int(query_start[r + 1])
        rows = torch.arange(first, end, device=query.device)
        fix = needs_fix[first:end].bool()
        if not fix.any():
            continue
        seq_len, n = int(seq_lens[r]), end - first
        start = seq_len - n
        pages = block_table[r, : (seq_len + page - 1) // page].long()
        k = key_cache[pages].flatten(0, 1)[:seq_len].float().repeat_interleave(group, dim=1)
        v = value_cache[pages].flatten(0, 1)[:seq_len].float().repeat_interleave(group, dim=1)
        visible = torch.ones(n, seq_len, dtype=torch.bool, device=query.device)
        bits = ancestors[first:end, None] >> torch.arange(n - 1, device=query.device)[None, :]
        visible[:, start + 1 :] = (bits & 1).bool()
        scores = torch.einsum("nhd,lhd->nhl", query[first:end].float(), k) * scale
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        result = torch.einsum("nhl,lhd->nhd", torch.softmax(scores, -1), v).to(out.dtype)
        out[rows[fix]] = result[fix]
