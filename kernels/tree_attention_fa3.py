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
- Arithmetic in FA3's order: P @ V added into the rescaled accumulator 16 keys at a
  time in column order, the tree's keys in their decoding chunks (in the window of
  chunks that holds the tree each row takes its own path's values: a dot per tree row,
  the other rows' P zero); row sums per quad lane over columns 8j + 2q, 8j + 2q + 1
  with each block's rescale fused into its first element, then (s0 + s2) + (s1 + s3);
  FA3's fast math as PTX (ex2 / rcp / lg2 .approx.ftz; the interpreter runs Triton's
  own, MATH 0).
- FA3 finalizes a split as O_s = acc_s * (1 / sum_s) and lse_s = max_s * scale_log2 *
  ln 2 + log(sum_s), and combines the splits with weights exp(lse_s - max) summed in a
  warp's xor-shuffle order (lane s: split s): out = sum_s weight_s O_s, split by split.
  One split: FA3's acc * (1 / sum) in the input dtype.

The facts are from FA3's Hopper code as vLLM builds it (vllm-project/flash-attention,
hopper/: tile_size.h, flash_api.cpp, flash_prepare_scheduler.cu, block.h, softmax.h,
mainloop_fwd_sm90_tma_gmma_ws.hpp, flash_fwd_combine_kernel.h; --use_fast_math). On the
H200 (2026-12-04c) the rows equal FA3's decoding call bit for bit in every case of
tests/gpu/test_tree_attention_kernel.py and benchmarks/fa3_exactness_bench.py. What it
cannot know: the decoding step FA3 scheduled (the target alone decodes beside other
requests at other positions: this kernel takes this step's requests, one row each, or
the blocks a caller names). tests/test_tree_attention_kernel.py holds it to
fa3_decoding_reference below on the CPU.

Layout and step description as tree_attention.py: key_cache / value_cache as [block,
slot, kv head, head dim], the batch's query_start / seq_lens / block table, per-row
ancestor bits (bit j - 1: tree row j >= 1 is an ancestor or the row itself) and needs_fix.
Programs: one per (request, KV head, FA3 split); a split's O and LSE go to the partial
buffers, and the last of a (request, KV head)'s splits to finish combines them, in the
same launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

# vLLM's split bound under FULL graphs (attn_metadata.max_num_splits).
FA3_SPLITS = 32
# Keys per sub-tile of FA3's key block in the kernel (SUB), taken in a loop that is not
# unrolled: ptxas for sm_90 (Triton 3.6) spills 724 bytes per thread at head dim 128
# with 32 (1,440 with 64, 808 with 16), where whole 128-key blocks spilled 2,684 (4,156
# with a 64-key window and the combine's whole head dim, 2026-12-04c).
FA3_KEY_SUB = 32
LN2 = 0.6931471805599453


def fa3_partial_rows(capacity_rows: int) -> int:
    """Rows of the splits' partial results for steps of up to capacity_rows rows: each
    request takes rows x cdiv(its blocks, blocks per multiprocessor), which sums to at
    most the step's rows plus 17 x 2 x 132 / 1.1 / KV heads (FA3's split rule: the
    step's blocks, with one more per request for its tree, over the blocks a
    multiprocessor takes)."""
    return capacity_rows + 4096


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
def _ptx(x, op: tl.constexpr):
    """One PTX float32 instruction `op` on x, elementwise (FA3's fast-math operations)."""
    return tl.inline_asm_elementwise(
        op + " $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def _exp2(x, MATH: tl.constexpr):
    """2^x: FA3's exp2f under --use_fast_math is ex2.approx.ftz (MATH >= 1)."""
    if MATH == 0:
        return tl.math.exp2(x)
    else:
        return _ptx(x, "ex2.approx.ftz.f32")


@triton.jit
def _reciprocal(x, MATH: tl.constexpr):
    """1 / x as FA3 takes it for its normalizers (0 where x is 0 or NaN, as FA3):
    rcp.approx.ftz (MATH 1) or div.full.ftz (MATH 2), the two fast-math readings of
    `1.f / sum`; MATH 0: IEEE division."""
    if MATH == 0:
        inv = 1.0 / x
    elif MATH == 1:
        inv = _ptx(x, "rcp.approx.ftz.f32")
    else:
        inv = tl.inline_asm_elementwise(
            "div.full.ftz.f32 $0, 0f3F800000, $1;",
            "=f,f",
            [x],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
    return tl.where((x == 0.0) | (x != x), 0.0, inv)


@triton.jit
def _log(x, MATH: tl.constexpr):
    """ln x: __logf is lg2.approx.ftz times ln 2 in float32."""
    if MATH == 0:
        return tl.log(x)
    else:
        return _ptx(x, "lg2.approx.ftz.f32") * 0.6931471805599453


@triton.jit
def _exp(x, MATH: tl.constexpr):
    """e^x: __expf is ex2.approx.ftz of x times log2(e) in float32."""
    if MATH == 0:
        return tl.exp(x)
    else:
        return _ptx(x * 1.4426950408889634, "ex2.approx.ftz.f32")


@triton.jit
def _add_thread_sums(parts, rescale, rescale_here, p, M: tl.constexpr, TILE: tl.constexpr):
    """parts [M, 4] + p [M, TILE] as FA3's threads sum a row: in a wgmma accumulator the
    thread of quad lane q holds columns 8j + 2q and 8j + 2q + 1, and adds them to its
    running sum one by one, j ascending. rescale_here: p holds the block's first columns,
    where FA3's `row_sum *= scale` and its first addition contract to one fma. Column
    group j is taken out of p by a masked sum, exact (one term is not zero)."""
    p3 = tl.reshape(p, [M, TILE // 8, 8])
    groups = tl.arange(0, TILE // 8)
    for j in range(0, TILE // 8):  # a loop, not unrolled: 32 copies compile for minutes
        pick = tl.sum(tl.where(groups[None, :, None] == j, p3, 0.0), axis=1)  # [M, 8]
        even, odd = tl.split(tl.reshape(pick, [M, 4, 2]))
        first = rescale_here & (j == 0)
        parts = tl.where(first, tl.fma(parts, rescale[:, None], even), parts + even)
        parts = parts + odd
    return parts


@triton.jit
def _quad_sum(parts, M: tl.constexpr):
    """FA3's quad all-reduce of the four threads' sums: (s0 + s2) + (s1 + s3)."""
    low, high = tl.split(tl.permute(tl.reshape(parts, [M, 2, 2]), (0, 2, 1)))  # q, q + 2
    first, second = tl.split(low + high)
    return first + second


@triton.jit
def _prefix_scores(q, cache, b, cols, start, in_split, BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """[M, len(cols)] S of key block b's columns `cols` over the request's prefix keys
    (-inf elsewhere and for rows whose split does not hold the block), and which of the
    columns are prefix keys."""
    pos = b * BLOCK_N + cols
    prefix = (cols < BLOCK_N) & (pos < start)
    k, _v = _load_kv(cache, pos, prefix, PAGE)
    scores = tl.dot(q, tl.trans(k))
    return tl.where(in_split[:, None] & prefix[None, :], scores, float("-inf")), prefix


@triton.jit
def _fold_halves(x, M: tl.constexpr, HALF: tl.constexpr):
    """[M, 2 HALF] -> [M, HALF]: element i plus element i + HALF, one xor-shuffle step
    of a warp's sum (lane i holding element i)."""
    low, high = tl.split(tl.permute(tl.reshape(x, [M, 2, HALF]), (0, 2, 1)))
    return low + high


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
def _partial_offset(QueryStart, SeqLens, req, per_sm, BLOCK_N: tl.constexpr, NUM_SPLITS):
    """First partial-result row of request `req`: the requests before it take rows x
    (a bound on their splits: cdiv(cdiv(root + rows, BLOCK_N), per_sm), at most
    NUM_SPLITS) rows each."""
    total = 0
    chunk = tl.arange(0, 128)
    for first in range(0, req, 128):
        r = first + chunk
        ok = r < req
        rows = tl.load(QueryStart + r + 1, mask=ok, other=0) - tl.load(
            QueryStart + r, mask=ok, other=0
        )
        root = tl.load(SeqLens + r, mask=ok, other=0) - rows
        bound = tl.minimum(tl.cdiv(tl.cdiv(root + rows, BLOCK_N), per_sm), NUM_SPLITS)
        total += tl.sum(tl.where(ok & (rows > 0), rows * bound, 0), axis=0)
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
    PartOut,  # [partial rows, H, D] float32: a split's O (FA3's O_partial)
    PartLse,  # [partial rows, H] float32: its log-sum-exp
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
    stride_pt,
    stride_ph,
    stride_lt,
    scale_log2,
    lse_scale,  # float32(scale_log2 * float32(ln 2)), FA3's LSE factor
    num_sms,
    batch_blocks,  # the decoding step's key blocks FA3 would schedule; 0: the requests'
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    ROWS: tl.constexpr,
    # A window of 16-key chunks that holds a tree's keys: next_power_of_2(15 + the most
    # rows a tree has), as the tree starts anywhere in its first chunk.
    WIN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    # Keys per sub-tile of a key block (a power of two, 16 at least): the block's scores
    # and P are taken a sub-tile at a time, in column order, which keeps FA3's MMA and
    # row-sum order (a whole block's [rows, BLOCK_N] tiles spilled registers on sm_90).
    SUB: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    MATH: tl.constexpr,  # 0: Triton's exp2 / IEEE division (the interpreter); 1, 2: FA3's
    THREAD_SUMS: tl.constexpr,  # row sums in FA3's per-thread order (else tl.sum)
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    M: tl.constexpr = ROWS * GROUP_PAD
    COMBINE_DIMS: tl.constexpr = 32  # head dims per step of the splits' combine
    first_row = tl.load(QueryStart + req)
    num_rows = tl.load(QueryStart + req + 1) - first_row
    # Query tile: (row, head in group) pairs.
    m_idx = tl.arange(0, M)
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
    if split >= used:
        return
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
    k_tree, _v_tree = _load_kv(cache, start + t, t_ok, PAGE)
    # Row i sees the root and tree row j >= 1 where bit j - 1 of its ancestor bits is set.
    shift = tl.maximum(t - 1, 0).to(tl.int64)
    seen = (t == 0)[None, :] | (((bits[:, None] >> shift[None, :]) & 1) != 0)  # [M, ROWS]
    seen = seen & t_ok[None, :]
    tree_scores = tl.dot(q, tl.trans(k_tree))  # [M, ROWS]: each entry as in decoding's S
    sub = tl.arange(0, SUB)
    w = tl.arange(0, WIN)
    lo = split * per_split  # [M]: each row's blocks of this split
    hi = tl.minimum(lo + per_split, blocks)
    lo_all = tl.min(tl.where(fix & (lo < hi), lo, 1 << 30), axis=0)
    hi_all = tl.max(tl.where(fix, hi, 0), axis=0)
    # FA3's state for one split: the running maximum, each quad lane's running row sum
    # (or the row sum), the output accumulator.
    row_max = tl.full([M], float("-inf"), tl.float32)
    parts = tl.zeros([M, 4], tl.float32)
    row_sum = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, HEAD_DIM], tl.float32)
    for i in range(0, hi_all - lo_all):
        b = hi_all - 1 - i  # a split's blocks from its last to its first, as FA3
        in_split = (b >= lo) & (b < hi)  # [M]
        # The block's maximum over its prefix keys, a sub-tile at a time.
        new_max = row_max
        for first in range(0, BLOCK_N, SUB):
            scores, _ = _prefix_scores(q, cache, b, first + sub, start, in_split, BLOCK_N, PAGE)
            new_max = tl.maximum(new_max, tl.max(scores, 1))
        # The tree's keys that this block holds at their decoding positions.
        here = (t_pos >= b * BLOCK_N) & (t_pos < b * BLOCK_N + BLOCK_N)
        visible = seen & here[None, :] & in_split[:, None]
        s_tree = tl.where(visible, tree_scores, float("-inf"))
        new_max = tl.maximum(new_max, tl.max(s_tree, 1))
        current = tl.where(new_max == float("-inf"), 0.0, new_max)
        max_scaled = current * scale_log2
        rescale = _exp2((row_max - current) * scale_log2, MATH)  # 0 before a row's first
        p_tree = _exp2(tl.fma(s_tree, scale_log2, -max_scaled[:, None]), MATH)
        holds_tree = b * BLOCK_N + BLOCK_N > start
        # P @ V added into the rescaled accumulator, FA3's MMA: 16-key chunks in order.
        # Chunks before the tree's window share V; in the window each row takes its own
        # path's values, a row class (tree row) at a time, the other rows' P zero.
        # The row sum over decoding's columns, likewise: the shared ones left of the
        # window, then the window's (zeros beyond it: adding them is exact).
        acc = acc * rescale[:, None]
        if not THREAD_SUMS:
            row_sum = row_sum * rescale
        first_tree = tl.maximum(start - b * BLOCK_N, 0)
        window = tl.where(holds_tree, (first_tree // 16) * 16, BLOCK_N)
        for first in range(0, BLOCK_N, SUB):
            if first < window:
                cols = first + sub
                scores, prefix = _prefix_scores(q, cache, b, cols, start, in_split, BLOCK_N, PAGE)
                p = _exp2(tl.fma(scores, scale_log2, -max_scaled[:, None]), MATH)
                p = tl.where(cols[None, :] < window, p, 0.0)
                _k, v = _load_kv(cache, b * BLOCK_N + cols, prefix, PAGE)
                acc = tl.dot(p.to(v.dtype), v, acc)
                if THREAD_SUMS:
                    parts = _add_thread_sums(parts, rescale, first == 0, p, M, SUB)
                else:
                    row_sum += tl.sum(p, 1)
        p_w = tl.zeros([M, WIN], tl.float32)  # the window's P (decoding's columns)
        if holds_tree:
            w_col = window + w  # [WIN] block columns
            w_pos = b * BLOCK_N + w_col
            w_in = w_col < BLOCK_N
            w_prefix = w_in & (w_pos < start)
            k_w, _v_w = _load_kv(cache, w_pos, w_prefix, PAGE)
            s_w = tl.dot(q, tl.trans(k_w))
            s_w = tl.where(in_split[:, None] & w_prefix[None, :], s_w, float("-inf"))
            p_w = _exp2(tl.fma(s_w, scale_log2, -max_scaled[:, None]), MATH)
            place_w = (t_pos[:, None] == w_pos[None, :]) & t_ok[:, None] & w_in[None, :]
            p_w = p_w + tl.dot(p_tree, place_w.to(tl.float32), input_precision="ieee")
            d_w = w_pos - start  # [WIN] the depth a window column holds
            # Only the rows that are fixed and whose split holds this block: the others'
            # P is zero here or their output is not kept (a dot of zeros adds nothing).
            live = (fix & in_split).to(tl.int32)  # [M]
            for c in range(0, num_rows):
                if tl.max(tl.where(row == c, live, 0), axis=0) > 0:
                    c_bits = tl.sum(tl.where(t == c, t_bits, 0), axis=0)
                    c_depth = tl.sum(tl.where(t == c, depth, 0), axis=0)
                    # Its path: tree row u at depth d where u is the root or an ancestor.
                    on_path = (t == 0) | (((c_bits >> shift) & 1) != 0)  # [ROWS]
                    hit = on_path[None, :] & t_ok[None, :] & (depth[None, :] == d_w[:, None])
                    u = tl.sum(tl.where(hit, t[None, :], 0), axis=1)  # [WIN]
                    w_tree = w_in & (d_w >= 0) & (d_w <= c_depth)
                    c_pos = tl.where(w_tree, start + u, w_pos)
                    _k_c, v_c = _load_kv(cache, c_pos, w_prefix | w_tree, PAGE)
                    p_c = tl.where((row == c)[:, None], p_w, 0.0)
                    acc = tl.dot(p_c.to(v_c.dtype), v_c, acc)
            if THREAD_SUMS:
                parts = _add_thread_sums(parts, rescale, window == 0, p_w, M, WIN)
            else:
                row_sum += tl.sum(p_w, 1)
        row_max = new_max
    if THREAD_SUMS:
        row_sum = _quad_sum(parts, M)
    inv = _reciprocal(row_sum, MATH)
    if used == 1:  # the only split: FA3's epilogue, O * (1 / sum) in the input dtype
        tl.store(
            Out
            + (first_row + row)[:, None] * stride_ot
            + head[:, None] * stride_oh
            + dims[None, :],
            (acc * inv[:, None]).to(Out.dtype.element_ty),
            mask=m_ok[:, None],
        )
    else:  # FA3's partial result (O_s, LSE_s), and its combine by the last split to end
        base = _partial_offset(QueryStart, SeqLens, req, per_sm, BLOCK_N, NUM_SPLITS)
        mine = base + split * num_rows + row
        tl.store(
            PartOut + mine[:, None] * stride_pt + head[:, None] * stride_ph + dims[None, :],
            acc * inv[:, None],
            mask=m_ok[:, None],
        )
        lse = tl.fma(row_max, lse_scale, _log(row_sum, MATH))
        lse = tl.where((row_sum == 0.0) | (row_sum != row_sum), float("-inf"), lse)
        tl.store(PartLse + mine * stride_lt + head, lse, mask=m_ok)
        # Every thread's stores are issued before the counter's release; the split that
        # counts last acquires them all.
        tl.debug_barrier()
        counter = Counters + req * tl.num_programs(1) + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == used - 1:
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # for the next launch
            lanes = tl.arange(0, NUM_SPLITS)
            at = base + lanes[None, :] * num_rows + row[:, None]  # [M, NUM_SPLITS]
            lse_all = tl.load(
                PartLse + at * stride_lt + head[:, None],
                mask=m_ok[:, None] & (lanes < used)[None, :],
                other=float("-inf"),
            )
            # FA3's combine (flash_fwd_combine_kernel.h): lane s of a warp holds split s.
            top = tl.max(lse_all, 1)
            top = tl.where(top == float("-inf"), 0.0, top)
            weights = _exp(lse_all - top[:, None], MATH)
            tl.static_assert(NUM_SPLITS == 32)  # a warp's lanes: five xor-shuffle steps
            total = _fold_halves(weights, M, 16)
            total = _fold_halves(_fold_halves(_fold_halves(total, M, 8), M, 4), M, 2)
            total = tl.reshape(_fold_halves(total, M, 1), [M])
            weights = weights * _reciprocal(total, MATH)[:, None]
            # O = sum over splits of weight x O_s, split by split; a few dims at a time
            # (each element's sum is its own: whole [rows, head dim] tiles of O and of
            # their addresses spilled registers on sm_90).
            tl.static_assert(HEAD_DIM % COMBINE_DIMS == 0)
            part_dims = tl.arange(0, COMBINE_DIMS)
            for d in range(0, HEAD_DIM, COMBINE_DIMS):
                out = tl.zeros([M, COMBINE_DIMS], tl.float32)
                for s in range(0, used):
                    weight = tl.sum(tl.where(lanes[None, :] == s, weights, 0.0), axis=1)  # [M]
                    o_s = tl.load(
                        PartOut
                        + (base + s * num_rows + row)[:, None] * stride_pt
                        + head[:, None] * stride_ph
                        + (d + part_dims)[None, :],
                        mask=m_ok[:, None] & (weight > 0.0)[:, None],
                        other=0.0,
                    )
                    out = tl.where((weight > 0.0)[:, None], tl.fma(weight[:, None], o_s, out), out)
                tl.store(
                    Out
                    + (first_row + row)[:, None] * stride_ot
                    + head[:, None] * stride_oh
                    + (d + part_dims)[None, :],
                    out.to(Out.dtype.element_ty),
                    mask=m_ok[:, None],
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
                lse = row_max * scale_log2 * LN2 + torch.log(row_sum)
                results.append((acc * (1.0 / row_sum)[:, None], lse))  # FA3: times 1 / sum
            if len(results) == 1:
                row_out = results[0][0]
            else:
                lse = torch.stack([x[1] for x in results])  # [S, H]
                lse_sum = torch.log(torch.exp(lse - lse.max(0).values).sum(0)) + lse.max(0).values
                row_out = sum(torch.exp(x[1] - lse_sum)[:, None] * x[0] for x in results)
            out[first + i] = row_out.to(out.dtype)
