"""Ancestor-only attention for draft-tree rows that rounds as FlashAttention-3 decodes
(Triton), graph-safe: the fix-up for targets on vLLM's FA3 backend.

Why: a tree row must round as FA3 rounds the same row when it decodes that row's own
path, or a small model's bf16 near-ties flip (the fast fix-up, tree_attention.py, left
SmolLM2-135M's greedy output on 64 of 100 prompts). FA3 over one request per root-to-leaf
path (engine/tree_paths.py) rounds right, but reads the request's prefix once per path:
on the H200 at batch 16 one pass over them took 107 us per layer, where the stock pass
alone took about 14 (benchmarks/results/h200_2026-12-03e). This
kernel reads the prefix once per (request, KV head, key split), as the fix-up does, and
takes for every row FA3's steps for that row's decoding:

- Keys come in blocks of BLOCK_N positions counted from 0 (fa3_block_n). Decoding sees
  the row's path at positions start .. start + depth (root first); in the cache the tree
  sits at start + tree index, so each tree key is placed at start + its depth (a row
  sees at most one key per depth: its ancestor's).
- Splits: FA3's scheduler gives each request of a decoding step a split count from the
  whole step's key blocks (clamp(cdiv(blocks, cdiv(1.1 x step blocks x KV heads /
  SMs)), 1, 32), 32 being vLLM's bound under FULL graphs); a split holds cdiv(blocks,
  splits) consecutive blocks, taken from its last to its first with FA3's online
  softmax: S = QK^T in float32, unscaled; the running maximum over visible keys;
  P = exp2(S * scale_log2 - max * scale_log2) (one FMA); the row sum from the float32
  P; P rounded to the input dtype before P @ V (float32 accumulation). The step taken
  is one decoding row per request of this step (or the blocks a caller names).
- FA3 finalizes a split as O_s = acc_s * (1 / sum_s), lse_s = max_s * scale_log2 * ln 2
  + log(sum_s), and combines the splits as out = sum_s exp(lse_s - lse_sum) O_s; that is
  sum_s exp2(max_s * scale_log2) acc_s / sum_s exp2(max_s * scale_log2) sum_s, which this
  kernel accumulates (one split: exactly FA3's acc * (1 / sum)).

The facts are from FA3's Hopper code as vLLM builds it (vllm-project/flash-attention,
hopper/: tile_size.h, flash_api.cpp, flash_prepare_scheduler.cu, block.h, softmax.h,
mainloop_fwd_sm90_tma_gmma_ws.hpp, flash_fwd_combine_kernel.h; --use_fast_math). What
cannot be matched: the decoding step FA3 scheduled (the target alone decodes beside
other requests at other positions: this kernel takes this step's requests, one row each);
the order of float32 sums (row sums, the products inside a block, the merge), about an
ulp. benchmarks/tree_rounding_bench.py measures how often the rows differ from FA3's own
decoding on the GPU; tests/test_tree_attention_kernel.py holds the kernel to
fa3_decoding_reference below.

Layout and step description as tree_attention.py: key_cache / value_cache as [block,
slot, kv head, head dim], the batch's query_start / seq_lens / block table, per-row
ancestor bits (bit j - 1: tree row j >= 1 is an ancestor or the row itself) and needs_fix.
Programs: one per (request, KV head, program split), each taking a run of FA3's splits
into one accumulator; the programs' results merge as the fix-up's do
(tree_attention._merge_splits), by the last program to finish, in the same launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tree_attention import _merge_splits

# vLLM's split bound under FULL graphs (attn_metadata.max_num_splits).
FA3_SPLITS = 32
LN2 = tl.constexpr(0.6931471805599453)  # a constexpr: the kernel reads it


def fa3_block_n(head_dim: int) -> int:
    """The key block FA3 (Hopper, 16-bit inputs) takes when it decodes with vLLM's
    16-slot pages (too small for TMA: hopper/flash_api.cpp): up to head dim 64 the
    kernel is non-causal, 192 keys with one MMA warpgroup at exactly 64 and 160 below
    (the one-warpgroup heuristic asks for head dim 64 or 128); above 64 it stays causal
    with paged keys, 128 keys (hopper/tile_size.h, heuristics.h)."""
    if head_dim < 64:
        return 160
    if head_dim == 64:
        return 192
    if head_dim <= 128:
        return 128
    raise ValueError(f"FA3-rounded tree rows: head dim {head_dim} > 128 is not covered")


@triton.jit
def _load_kv(cache, pos, ok, PAGE: tl.constexpr):
    """([N, D] keys, [N, D] values) of positions `pos` of a request's paged cache; cache:
    (K, V, block table, request, KV head, strides, dims), the strides (block table row,
    K block, K slot, K head, V block, V slot, V head)."""
    K, V, BlockTable, req, kv_head, strides, dims = cache
    stride_bt, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh = strides
    page = tl.load(BlockTable + req * stride_bt + pos // PAGE, mask=ok, other=0)
    slot = pos % PAGE
    k = tl.load(
        K
        + page[:, None] * stride_kb
        + slot[:, None] * stride_ks
        + kv_head * stride_kh
        + dims[None, :],
        mask=ok[:, None],
        other=0.0,
    )
    v = tl.load(
        V
        + page[:, None] * stride_vb
        + slot[:, None] * stride_vs
        + kv_head * stride_vh
        + dims[None, :],
        mask=ok[:, None],
        other=0.0,
    )
    return k, v


@triton.jit
def _tree_scores(q, cache, tree, in_split, b, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """([M, ROWS] unscaled scores of the tree's keys that block b holds at their decoding
    positions and each row sees, -inf elsewhere; [ROWS, D] the keys' values); tree:
    (root position, tree indices, which exist, decoding positions, the rows' ancestor
    bits). Loaded again where needed: the last block or two of a split only, and so
    nothing of it stays in registers across the block loop."""
    start, t, t_ok, t_pos, bits = tree
    k_tree, v_tree = _load_kv(cache, start + t, t_ok, PAGE)
    here = (t_pos >= b * BLOCK_N) & (t_pos < b * BLOCK_N + BLOCK_N)
    # Row i sees the root and tree row j >= 1 where bit j - 1 of its ancestor bits is set.
    shift = tl.maximum(t - 1, 0).to(tl.int64)
    seen = (t == 0)[None, :] | (((bits[:, None] >> shift[None, :]) & 1) != 0)
    seen = seen & (t_ok & here)[None, :] & in_split[:, None]
    scores = tl.where(seen, tl.dot(q, tl.trans(k_tree)), float("-inf"))
    return scores, v_tree


@triton.jit
def _batch_blocks(QueryStart, SeqLens, BLOCK_N: tl.constexpr):
    """Key blocks of the step's requests decoding one row each (their roots); a graph's
    padding requests (no rows) have none, as FA3 counts a request of no keys."""
    total = 0
    chunk = tl.arange(0, 128)
    for first in range(0, tl.num_programs(0), 128):
        r = first + chunk
        ok = r < tl.num_programs(0)
        rows = tl.load(QueryStart + r + 1, mask=ok, other=0) - tl.load(
            QueryStart + r, mask=ok, other=0
        )
        root = tl.load(SeqLens + r, mask=ok, other=0) - rows
        total += tl.sum(tl.where(ok & (rows > 0), tl.cdiv(root + 1, BLOCK_N), 0), axis=0)
    return total


@triton.jit
def tree_rows_attention_fa3(
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
    scale_log2,
    splits_per_program,
    num_sms,
    batch_blocks,  # the decoding step's key blocks FA3 would schedule; 0: the requests'
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KEY_TILE: tl.constexpr,  # BLOCK_N rounded up to a power of two
    NUM_SPLITS: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    program = tl.program_id(2)
    first_row = tl.load(QueryStart + req)
    num_rows = tl.load(QueryStart + req + 1) - first_row
    # Query tile: (row, head in group) pairs, M = ROWS * GROUP_PAD.
    m_idx = tl.arange(0, ROWS * GROUP_PAD)
    row = m_idx // GROUP_PAD
    group_head = m_idx % GROUP_PAD
    row_ok = row < num_rows
    fix = row_ok & (tl.load(NeedsFix + first_row + row, mask=row_ok, other=0) != 0)
    if tl.max(fix.to(tl.int32), axis=0) == 0:
        return
    start = tl.load(SeqLens + req) - num_rows  # the root's position
    bits = tl.load(Ancestors + first_row + row, mask=row_ok, other=0)  # [M]
    # The tree's keys: tree index t sits in the cache at start + t, and decoding puts it
    # at start + its depth (the number of its ancestor bits, itself included).
    t = tl.arange(0, ROWS)
    t_ok = t < num_rows
    t_bits = tl.load(Ancestors + first_row + t, mask=t_ok, other=0)  # [ROWS]
    depth = tl.sum((t_bits[:, None] >> t[None, :].to(tl.int64)) & 1, axis=1)  # [ROWS]
    t_pos = start + depth
    # Each row decodes start + depth + 1 keys: its blocks, cut into splits as FA3's
    # scheduler cuts a decoding step's (flash_prepare_scheduler.cu): a split count per
    # request from the whole batch's blocks, taken here as one decoding row per request.
    row_depth = tl.sum(tl.where(row[:, None] == t[None, :], depth[None, :], 0), axis=1)  # [M]
    blocks = tl.cdiv(start + row_depth + 1, BLOCK_N)
    if batch_blocks == 0:
        batch_blocks = _batch_blocks(QueryStart, SeqLens, BLOCK_N)
    per_sm = tl.math.ceil(batch_blocks.to(tl.float32) * 1.1 * tl.num_programs(1) / num_sms).to(
        tl.int32
    )
    splits = tl.maximum(tl.minimum(tl.cdiv(blocks, per_sm), NUM_SPLITS), 1)
    per_split = tl.cdiv(blocks, splits)
    used = tl.max(tl.where(fix, tl.cdiv(blocks, per_split), 0), axis=0)  # FA3 splits
    first_split = program * splits_per_program
    if first_split >= used:  # none of this program's splits holds keys: not counted
        return
    programs_used = tl.cdiv(used, splits_per_program)
    head = kv_head * GROUP + group_head
    m_ok = fix & (group_head < GROUP)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        Q + (first_row + row)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=m_ok[:, None],
        other=0.0,
    )
    strides = (stride_bt, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh)
    cache = (K, V, BlockTable, req, kv_head, strides, dims)
    tree = (start, t, t_ok, t_pos, bits)
    offsets = tl.arange(0, KEY_TILE)
    # One accumulator for all of this program's FA3 splits, kept at the running maximum
    # `top` over them: a split's P is rounded against its own running maximum (FA3's
    # steps), and its products P @ V enter the accumulator scaled from that maximum to
    # `top`. This is FA3's combine of the splits (out = sum_s exp(lse_s) O_s / sum_s
    # exp(lse_s)) with the float32 sums taken in another order, and needs no second
    # [rows, head dim] accumulator.
    top = tl.full([ROWS * GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([ROWS * GROUP_PAD], tl.float32)  # sum_s exp2((max_s - top) c) sum_s
    acc = tl.zeros([ROWS * GROUP_PAD, HEAD_DIM], tl.float32)
    for split in range(first_split, tl.minimum(first_split + splits_per_program, used)):
        lo = split * per_split  # [M]: each row's blocks of this split
        hi = tl.minimum(lo + per_split, blocks)
        lo_all = tl.min(tl.where(fix & (lo < hi), lo, 1 << 30), axis=0)
        hi_all = tl.max(tl.where(fix, hi, 0), axis=0)
        row_max = tl.full([ROWS * GROUP_PAD], float("-inf"), tl.float32)  # the split's
        row_sum = tl.zeros([ROWS * GROUP_PAD], tl.float32)
        for i in range(0, hi_all - lo_all):
            b = hi_all - 1 - i  # a split's blocks from its last to its first, as FA3
            in_split = (b >= lo) & (b < hi)  # [M]
            pos = b * BLOCK_N + offsets
            key_ok = (offsets < BLOCK_N) & (pos < start)  # the block's prefix keys
            k, v = _load_kv(cache, pos, key_ok, PAGE)
            scores = tl.dot(q, tl.trans(k))
            scores = tl.where(in_split[:, None] & key_ok[None, :], scores, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(scores, 1))
            # The tree's keys at their decoding positions: in the last block or two only.
            holds_tree = b * BLOCK_N + BLOCK_N > start
            if holds_tree:
                tree_scores, _ = _tree_scores(q, cache, tree, in_split, b, PAGE, BLOCK_N)
                new_max = tl.maximum(new_max, tl.max(tree_scores, 1))
            current = tl.where(new_max == float("-inf"), 0.0, new_max)
            max_scaled = current * scale_log2
            p = tl.math.exp2(tl.fma(scores, scale_log2, -max_scaled[:, None]))
            row_sum = row_sum * tl.math.exp2((row_max - current) * scale_log2) + tl.sum(p, 1)
            products = tl.dot(p.to(v.dtype), v)
            if holds_tree:
                p_tree, v_tree = _tree_scores(q, cache, tree, in_split, b, PAGE, BLOCK_N)
                p_tree = tl.math.exp2(tl.fma(p_tree, scale_log2, -max_scaled[:, None]))
                row_sum += tl.sum(p_tree, 1)
                products += tl.dot(p_tree.to(v.dtype), v_tree)
            # A row without keys in this block (not in this split) keeps its scale.
            has_keys = new_max > float("-inf")
            new_top = tl.where(has_keys, tl.maximum(top, current), top)
            shrink = tl.where(new_top == top, 1.0, tl.math.exp2((top - new_top) * scale_log2))
            grow = tl.where(has_keys, tl.math.exp2((current - new_top) * scale_log2), 0.0)
            acc = acc * shrink[:, None] + grow[:, None] * products
            total *= shrink
            top = new_top
            row_max = new_max
        # The split's sum enters at the accumulator's scale (a row without keys: none).
        total += tl.where(row_sum > 0.0, tl.math.exp2((row_max - top) * scale_log2) * row_sum, 0.0)
    if programs_used == 1:  # the only program: normalize (as FA3: times 1 / sum) and write
        out = acc * tl.where(total == 0.0, 0.0, 1.0 / total)[:, None]
        tl.store(
            Out
            + (first_row + row)[:, None] * stride_ot
            + head[:, None] * stride_oh
            + dims[None, :],
            out.to(Out.dtype.element_ty),
            mask=m_ok[:, None],
        )
    else:  # the partial result at natural-log scale top * scale_log2 * ln 2
        rows_at = first_row + row
        tl.store(
            PartAcc
            + program * stride_ps
            + rows_at[:, None] * stride_pt
            + head[:, None] * stride_ph
            + dims[None, :],
            acc,
            mask=m_ok[:, None],
        )
        tl.store(
            PartMax + program * stride_ms + rows_at * stride_mt + head,
            tl.where(top == float("-inf"), 0.0, top * scale_log2 * LN2),
            mask=m_ok,
        )
        tl.store(PartSum + program * stride_ms + rows_at * stride_mt + head, total, mask=m_ok)
        # Every thread's stores are issued before the counter's release; the program
        # that counts last acquires them all and merges the programs' results.
        tl.debug_barrier()
        counter = Counters + req * tl.num_programs(1) + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == programs_used - 1:
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # for the next launch
            _merge_splits(
                PartAcc,
                PartMax,
                PartSum,
                Out,
                rows_at,
                head,
                m_ok,
                programs_used,
                stride_ps,
                stride_pt,
                stride_ph,
                stride_ms,
                stride_mt,
                stride_ot,
                stride_oh,
                HEAD_DIM,
            )


def fa3_decoding_reference(
    query,
    key_cache,
    value_cache,
    block_table,
    query_start,
    seq_lens,
    ancestors,
    needs_fix,
    scale: float,
    out,
    num_sms: int = 132,
    block_n: int | None = None,
    batch_blocks: int = 0,
) -> None:
    """Each fixed row as FA3 decodes its own path, step by step in torch (the FA3
    kernel's oracle for its rounding; on the GPU, benchmarks/tree_rounding_bench.py
    holds it against FA3 itself): the path's keys at their decoding positions, blocks of
    block_n (fa3_block_n), FA3's split count, each split from its last block to its
    first, P rounded to the input dtype before P @ V, the splits combined. batch_blocks:
    as the kernel's (0: one decoding row per request)."""
    import torch

    kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    group = query.shape[1] // kv_heads
    page = key_cache.shape[1]
    block_n = block_n or fa3_block_n(head_dim)
    device, heads = query.device, query.shape[1]
    scale_log2 = torch.tensor(scale * 1.4426950408889634, dtype=torch.float32, device=device)
    rows = query_start[1:] - query_start[:-1]
    roots = (seq_lens - rows).long()
    total = batch_blocks or int(((roots + block_n) // block_n)[rows > 0].sum())
    total = torch.tensor(total, dtype=torch.float32)
    per_sm = int(torch.ceil(total * 1.1 * kv_heads / num_sms))
    for r in range(seq_lens.numel()):
        first, n, start = int(query_start[r]), int(rows[r]), int(roots[r])
        pages = block_table[r, : (int(seq_lens[r]) + page - 1) // page].long()
        k_all = key_cache[pages].flatten(0, 1)
        v_all = value_cache[pages].flatten(0, 1)
        for i in range(n):
            if not needs_fix[first + i]:
                continue
            bits = int(ancestors[first + i])
            path = [0] + [t for t in range(1, n) if bits >> (t - 1) & 1]
            keys = torch.cat([torch.arange(start), start + torch.tensor(path)]).to(device)
            k = k_all[keys].repeat_interleave(group, dim=1)  # [L, H, D]
            v = v_all[keys].repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,lhd->hl", query[first + i].float(), k.float())
            length = keys.numel()
            blocks = -(-length // block_n)
            splits = max(min(-(-blocks // per_sm), FA3_SPLITS), 1)
            per_split = -(-blocks // splits)
            results = []
            for lo in range(0, blocks, per_split):
                row_max = torch.full((heads,), float("-inf"), device=device)
                row_sum = torch.zeros(heads, device=device)
                acc = torch.zeros(heads, head_dim, device=device)
                for b in reversed(range(lo, min(lo + per_split, blocks))):
                    keys_b = slice(b * block_n, min((b + 1) * block_n, length))
                    s = scores[:, keys_b]
                    new_max = torch.maximum(row_max, s.max(1).values)
                    current = torch.where(new_max == float("-inf"), 0.0, new_max)
                    rescale = torch.exp2((row_max - current) * scale_log2)
                    p = torch.exp2(s * scale_log2 - (current * scale_log2)[:, None])
                    row_sum = row_sum * rescale + p.sum(1)
                    pv = torch.einsum("hl,lhd->hd", p.to(v.dtype).float(), v[keys_b].float())
                    acc = acc * rescale[:, None] + pv
                    row_max = new_max
                lse = row_max * scale_log2 * LN2.value + torch.log(row_sum)
                results.append((acc * (1.0 / row_sum)[:, None], lse))  # FA3: times 1 / sum
            if len(results) == 1:
                row_out = results[0][0]
            else:
                lse = torch.stack([x[1] for x in results])  # [S, H]
                lse_sum = torch.log(torch.exp(lse - lse.max(0).values).sum(0)) + lse.max(0).values
                row_out = sum(torch.exp(x[1] - lse_sum)[:, None] * x[0] for x in results)
            out[first + i] = row_out.to(out.dtype)
