"""Ancestor-only attention for draft-tree rows over a paged KV cache (Triton).

vLLM's kernels run every verification row causally over the request's linear order;
a tree row must instead see the committed prefix, its ancestors and itself. This kernel
recomputes exactly the tree rows.

Work split (flash-decoding): a program takes one block of up to ROW_BLOCK rows of one
tree, one KV head (all the query heads of its GQA group at once, so the query tile is
ROW_BLOCK x GROUP rows for tl.dot) and one slice of the request's keys; slices are
merged by log-sum-exp afterwards. When every tree's keys fit one slice (contexts up to
SLICE tokens), the slice kernel writes the output itself: one launch per layer. Keys
before the tree's root position are visible to every row; a key inside the tree is
visible to row i iff the tree's mask says so.

Layout: key_cache / value_cache index as [block, slot in block, kv head, head dim]
(vLLM's FlashAttention / Triton backends' NHD layout; any strides). A request's tree
rows are consecutive query rows and sit at positions start .. start + size - 1 of the
request's pages, like any token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

ROW_BLOCK = 16  # tree rows per program
KEY_TILE = 64  # keys per inner step
SLICE = 512  # keys per program (a multiple of KEY_TILE)


@dataclass
class TreeBatchMeta:
    """The trees of one forward (device tensors)."""

    first_rows: torch.Tensor  # [B] int32: query row of each tree's root
    requests: torch.Tensor  # [B] int32: block-table row
    starts: torch.Tensor  # [B] int32: position of the root
    sizes: torch.Tensor  # [B] int32: rows in the tree (root included)
    masks: torch.Tensor  # [B, S, S] int8: masks[b, i, j] = 1 iff row j is visible to row i
    rows: torch.Tensor  # [M = sum of sizes] long: every tree row (the rows written)
    offsets: torch.Tensor  # [B] int32: index of each tree's root among the M tree rows
    row_trees: torch.Tensor  # [M] int32: the tree of each of the M tree rows
    max_size: int  # max of sizes (host int: it sizes the launch grid)
    max_seq_len: int  # max of starts + sizes (host int)


@triton.jit
def _tree_attention_slices(
    Q, K, V, BlockTable, FirstRows, Requests, Starts, Sizes, Masks, Offsets,
    PartAcc, PartMax, PartSum, Out,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, stride_mb, stride_mi, stride_pa_s, stride_pa_t, stride_pa_h,
    stride_pm_s, stride_pm_t, stride_ot, stride_oh, scale, row_blocks,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    ROW_BLOCK: tl.constexpr, KEY_TILE: tl.constexpr, SLICE: tl.constexpr,
    DIRECT: tl.constexpr,
):  # fmt: skip
    tree = tl.program_id(0) // row_blocks
    row_block = tl.program_id(0) % row_blocks
    kv_head = tl.program_id(1)
    key_slice = tl.program_id(2)
    size = tl.load(Sizes + tree)
    start = tl.load(Starts + tree)
    seq_len = start + size
    first_key = key_slice * SLICE
    if row_block * ROW_BLOCK >= size or first_key >= seq_len:
        return
    request = tl.load(Requests + tree)
    first_row = tl.load(FirstRows + tree)

    # Query tile: (tree row, head in group) pairs, M = ROW_BLOCK * GROUP_PAD.
    m_idx = tl.arange(0, ROW_BLOCK * GROUP_PAD)
    tree_row = row_block * ROW_BLOCK + m_idx // GROUP_PAD
    group_head = m_idx % GROUP_PAD
    m_ok = (tree_row < size) & (group_head < GROUP)
    head = kv_head * GROUP + group_head
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (first_row + tree_row)[:, None] * stride_qt + head[:, None] * stride_qh
                + dims[None, :], mask=m_ok[:, None], other=0.0)  # fmt: skip

    best = tl.full([ROW_BLOCK * GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([ROW_BLOCK * GROUP_PAD], tl.float32)
    acc = tl.zeros([ROW_BLOCK * GROUP_PAD, HEAD_DIM], tl.float32)
    offsets = tl.arange(0, KEY_TILE)
    last_key = tl.minimum(first_key + SLICE, seq_len)
    for tile in range(first_key, last_key, KEY_TILE):
        pos = tile + offsets
        key_ok = pos < last_key
        block = tl.load(BlockTable + request * stride_bt + pos // PAGE, mask=key_ok, other=0)
        slot = pos % PAGE
        k_ptr = K + block[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh
        v_ptr = V + block[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh
        k = tl.load(k_ptr + dims[None, :], mask=key_ok[:, None], other=0.0)
        v = tl.load(v_ptr + dims[None, :], mask=key_ok[:, None], other=0.0)
        in_tree = (pos >= start) & key_ok
        flags = tl.load(Masks + tree * stride_mb + tree_row[:, None] * stride_mi
                        + (pos - start)[None, :],
                        mask=m_ok[:, None] & in_tree[None, :], other=0)  # fmt: skip
        visible = ((pos < start) & key_ok)[None, :] | (flags != 0)
        scores = tl.dot(q, tl.trans(k)) * scale
        scores = tl.where(visible, scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        # Rows that have seen no visible key yet keep -inf; avoid inf - inf.
        shift = tl.where(new_best == float("-inf"), 0.0, new_best)
        weights = tl.exp(scores - shift[:, None])
        correction = tl.exp(best - shift)
        total = total * correction + tl.sum(weights, axis=1)
        acc = acc * correction[:, None] + tl.dot(weights.to(v.dtype), v)
        best = new_best
    if DIRECT:  # the only slice: normalize and write the rows' output
        out = acc / total[:, None]
        tl.store(Out + (first_row + tree_row)[:, None] * stride_ot + head[:, None] * stride_oh
                 + dims[None, :], out.to(Out.dtype.element_ty), mask=m_ok[:, None])  # fmt: skip
        return
    out_row = tl.load(Offsets + tree) + tree_row  # compact index among the tree rows
    tl.store(PartAcc + key_slice * stride_pa_s + out_row[:, None] * stride_pa_t
             + head[:, None] * stride_pa_h + dims[None, :], acc, mask=m_ok[:, None])  # fmt: skip
    tl.store(PartMax + key_slice * stride_pm_s + out_row * stride_pm_t + head, best, mask=m_ok)
    tl.store(PartSum + key_slice * stride_pm_s + out_row * stride_pm_t + head, total, mask=m_ok)


@triton.jit
def _merge_slices(
    PartAcc, PartMax, PartSum, Rows, RowTrees, Starts, Sizes, Out,
    stride_pa_s, stride_pa_t, stride_pa_h, stride_pm_s, stride_pm_t, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, SLICE: tl.constexpr,
):  # fmt: skip
    """Log-sum-exp merge of one tree row's key slices, for one head."""
    m = tl.program_id(0)
    head = tl.program_id(1)
    tree = tl.load(RowTrees + m)
    num_slices = tl.cdiv(tl.load(Starts + tree) + tl.load(Sizes + tree), SLICE)
    dims = tl.arange(0, HEAD_DIM)
    best = float("-inf")
    for s in range(0, num_slices):
        best = tl.maximum(best, tl.load(PartMax + s * stride_pm_s + m * stride_pm_t + head))
    total = 0.0
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for s in range(0, num_slices):
        weight = tl.exp(tl.load(PartMax + s * stride_pm_s + m * stride_pm_t + head) - best)
        total += weight * tl.load(PartSum + s * stride_pm_s + m * stride_pm_t + head)
        acc += weight * tl.load(PartAcc + s * stride_pa_s + m * stride_pa_t + head * stride_pa_h
                                + dims)  # fmt: skip
    row = tl.load(Rows + m)
    tl.store(
        Out + row * stride_ot + head * stride_oh + dims, (acc / total).to(Out.dtype.element_ty)
    )


def tree_attention(
    query: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,  # [num_blocks, page, KVH, D]
    value_cache: torch.Tensor,  # [num_blocks, page, KVH, D]
    block_table: torch.Tensor,  # [R, max_blocks] int32
    meta: TreeBatchMeta,
    scale: float,
    out: torch.Tensor,  # [T, H, D]: tree rows are overwritten, other rows untouched
) -> None:
    num_trees = meta.sizes.numel()
    if num_trees == 0:
        return
    heads, head_dim = query.shape[1:]
    kv_heads, page = key_cache.shape[2], key_cache.shape[1]
    group = heads // kv_heads
    group_pad = max(triton.next_power_of_2(group), 1)
    row_blocks = triton.cdiv(meta.max_size, ROW_BLOCK)
    slices = triton.cdiv(meta.max_seq_len, SLICE)
    num_rows = meta.rows.numel()
    direct = slices == 1
    # Every (slice, tree row, head) the merge reads is written by the slice kernel.
    part_shape = (0, 0, 0) if direct else (slices, num_rows, heads)
    part_acc = torch.empty(*part_shape, head_dim, device=query.device)
    part_max = torch.empty(part_shape, device=query.device)
    part_sum = torch.empty(part_shape, device=query.device)
    _tree_attention_slices[(num_trees * row_blocks, kv_heads, slices)](
        query, key_cache, value_cache, block_table,
        meta.first_rows, meta.requests, meta.starts, meta.sizes, meta.masks, meta.offsets,
        part_acc, part_max, part_sum, out,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0), meta.masks.stride(0), meta.masks.stride(1),
        part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
        part_max.stride(0), part_max.stride(1), out.stride(0), out.stride(1), scale, row_blocks,
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, PAGE=page,
        ROW_BLOCK=ROW_BLOCK, KEY_TILE=KEY_TILE, SLICE=SLICE, DIRECT=direct,
    )  # fmt: skip
    if direct:
        return
    _merge_slices[(num_rows, heads)](
        part_acc, part_max, part_sum, meta.rows, meta.row_trees, meta.starts, meta.sizes, out,
        part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
        part_max.stride(0), part_max.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, SLICE=SLICE,
    )  # fmt: skip


def tree_attention_reference(query, key_cache, value_cache, block_table, meta, scale, out):
    """Dense torch version (gather the pages, masked softmax): the kernel's oracle."""
    group = query.shape[1] // key_cache.shape[2]
    page = key_cache.shape[1]
    for b in range(meta.sizes.numel()):
        first, req = int(meta.first_rows[b]), int(meta.requests[b])
        start, size = int(meta.starts[b]), int(meta.sizes[b])
        seq_len = start + size
        pages = block_table[req, : (seq_len + page - 1) // page].long()
        k = key_cache[pages].flatten(0, 1)[:seq_len].float().repeat_interleave(group, dim=1)
        v = value_cache[pages].flatten(0, 1)[:seq_len].float().repeat_interleave(group, dim=1)
        visible = torch.ones(size, seq_len, dtype=torch.bool, device=query.device)
        visible[:, start:] = meta.masks[b, :size, :size].bool()
        q = query[first : first + size].float()  # [n, H, D]
        scores = torch.einsum("nhd,lhd->nhl", q, k) * scale
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        out[first : first + size] = torch.einsum("nhl,lhd->nhd", torch.softmax(scores, -1), v).to(
            out.dtype
        )
