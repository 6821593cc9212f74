"""Ancestor-only attention for draft-tree rows over a paged KV cache (Triton).

vLLM's kernels run every verification row causally over the request's linear order;
a tree row must instead see the committed prefix, its ancestors and itself. This kernel
recomputes exactly the tree rows: one program per (tree row, KV head), all query heads
of the KV head's group at once (GQA), online softmax over the request's pages.

Layout: key_cache / value_cache index as [block, slot in block, kv head, head dim]
(vLLM's FlashAttention / Triton backends' NHD layout; any strides). The tree's own rows
sit at positions start .. start + n - 1 of the request, in its pages, like any token.

Per tree row (TreeRowsMeta): the query/output row, the request's block-table row, the
root position `start`, the tree's row count `n`, and a mask row of `n` flags: which
tree rows (0 = root) this row may attend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass
class TreeRowsMeta:
    rows: torch.Tensor  # [M] int32: query / output row of each tree row
    requests: torch.Tensor  # [M] int32: block-table row
    starts: torch.Tensor  # [M] int32: position of the tree's root
    sizes: torch.Tensor  # [M] int32: rows in the tree (root included)
    masks: torch.Tensor  # [M, max_size] int8: masks[m, i] = 1 iff tree row i is visible


@triton.jit
def _tree_rows_attention_kernel(
    Q, K, V, Out, BlockTable, Rows, Requests, Starts, Sizes, Masks,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, stride_mask, scale,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
):  # fmt: skip
    m = tl.program_id(0)
    kv_head = tl.program_id(1)
    row = tl.load(Rows + m)
    request = tl.load(Requests + m)
    start = tl.load(Starts + m)
    size = tl.load(Sizes + m)
    seq_len = start + size

    heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)
    head_ok = tl.arange(0, GROUP_PAD) < GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + row * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=head_ok[:, None], other=0.0)  # fmt: skip

    best = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    slots = tl.arange(0, PAGE)
    for page_start in range(0, seq_len, PAGE):
        block = tl.load(BlockTable + request * stride_bt + page_start // PAGE)
        pos = page_start + slots
        tree_index = pos - start
        in_tree = (tree_index >= 0) & (pos < seq_len)
        flags = tl.load(Masks + m * stride_mask + tree_index, mask=in_tree, other=0)
        visible = (pos < start) | (in_tree & (flags != 0))
        k = tl.load(K + block * stride_kb + slots[:, None] * stride_ks
                    + kv_head * stride_kh + dims[None, :])  # fmt: skip
        v = tl.load(V + block * stride_vb + slots[:, None] * stride_vs
                    + kv_head * stride_vh + dims[None, :])  # fmt: skip
        scores = tl.sum(q[:, None, :].to(tl.float32) * k[None, :, :].to(tl.float32), axis=2)
        scores = tl.where(visible[None, :], scores * scale, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        correction = tl.exp(best - new_best)
        weights = tl.exp(scores - new_best[:, None])
        total = total * correction + tl.sum(weights, axis=1)
        acc = acc * correction[:, None] + tl.sum(
            weights[:, :, None] * v[None, :, :].to(tl.float32), axis=1
        )
        best = new_best
    out = acc / total[:, None]
    tl.store(Out + row * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             out.to(Out.dtype.element_ty), mask=head_ok[:, None])  # fmt: skip


def tree_rows_attention(
    query: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,  # [num_blocks, page, KVH, D]
    value_cache: torch.Tensor,  # [num_blocks, page, KVH, D]
    block_table: torch.Tensor,  # [R, max_blocks] int32
    meta: TreeRowsMeta,
    scale: float,
    out: torch.Tensor,  # [T, H, D]: tree rows are overwritten, others untouched
) -> None:
    num_rows = meta.rows.numel()
    if num_rows == 0:
        return
    heads, head_dim = query.shape[1], query.shape[2]
    kv_heads, page = key_cache.shape[2], key_cache.shape[1]
    group = heads // kv_heads
    _tree_rows_attention_kernel[(num_rows, kv_heads)](
        query, key_cache, value_cache, out, block_table,
        meta.rows, meta.requests, meta.starts, meta.sizes, meta.masks,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0), meta.masks.stride(0), scale,
        GROUP=group, GROUP_PAD=max(triton.next_power_of_2(group), 1), HEAD_DIM=head_dim,
        PAGE=page,
    )  # fmt: skip


def tree_rows_attention_reference(query, key_cache, value_cache, block_table, meta, scale, out):
    """Dense torch version (gather the pages, masked softmax): the kernel's oracle."""
    group = query.shape[1] // key_cache.shape[2]
    page = key_cache.shape[1]
    for m in range(meta.rows.numel()):
        row, req = int(meta.rows[m]), int(meta.requests[m])
        start, size = int(meta.starts[m]), int(meta.sizes[m])
        seq_len = start + size
        pages = block_table[req, : (seq_len + page - 1) // page].long()
        k = key_cache[pages].flatten(0, 1)[:seq_len].float()  # [L, KVH, D]
        v = value_cache[pages].flatten(0, 1)[:seq_len].float()
        visible = torch.ones(seq_len, dtype=torch.bool, device=query.device)
        visible[start:] = meta.masks[m, :size].bool()
        q = query[row].float()  # [H, D]
        k = k.repeat_interleave(group, dim=1)  # [L, H, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q, k) * scale
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out[row] = torch.einsum("hl,lhd->hd", torch.softmax(scores, -1), v).to(out.dtype)
