"""Domino's per-node step on CUDA in two launches, for the best-first builders.

A pop of the build asks the conditional scorer for the children of one new node per
request (tree/scorers.py): the GRU's update over the node's token, the correction of its
depth's top-M candidates, their log-softmax and the top C. As torch code that is about
fifteen small kernels per pop (two cuBLAS products, the gates, gathers and scatters,
Inductor's reductions), each a few microseconds on the H200 and dependent on the last:
launches and their gaps, not bytes, bound a pop. Here it is two, and the device
builder's bookkeeping rides in the last:

- `_gru_step`: both GRU products and the gates for a block of hidden units, every row
  at once (the n gate takes r x (W_hn h), so the two products stay apart inside the
  program) -> the node's state, in the scorer's state table, and the block's share of
  the correction's input, W_s[:, block] S[block] (64 blocks x 256 float32 a row for the
  released drafter: 64 KB, where W_s itself is 0.5 MB, too much for one program per row
  to read fast). At small batches its reductions are split over programs (16 units x
  16 rows are only 64 programs for the released GRU of 1024), the last of a unit
  block's splits adding their partial products in a fixed order.
- `_children`: per row, u = silu(W_h h_d + the blocks' shares, summed in block order),
  the correction on the M candidates, the log-softmax, the top C (best first, equal
  values in candidate order, as the torch step's ranks; by rank, in one pass) and, in
  the device builder, the pop of kernels/tree_pop.py on the row's frontier, which gives
  the next pop's inputs. (Until 2026-12-05 the pop was a launch of its own and the top C
  took C rounds of argmax: 2.2 and 8.4 us a pop at batch 1 on the H200,
  benchmarks/results/h200_2026-12-03e; u was a launch of its own until 2026-12-05d.)

Every product accumulates in float32 (IEEE for float32 drafters, where tensor cores
would round to TF32). A row's arithmetic does not depend on the other rows, and both
builders (the device builder and the host heap, tree/builder.py) call these same
kernels on the same padded row count, the host heap's without the pop, so their trees
stay bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .tree_pop import file_and_pop

ROWS_BLOCK = 16  # rows per program of the two products (tensor-core tiles: >= 16)
GRU_PROGRAMS = 256  # programs the GRU step aims for (its reduction split to get there)
MAX_SPLITS = 8
UNITS_BLOCK = 16  # GRU hidden units, or correction-rank entries, per program
# Reduction width per step of the GRU's products (16-bit weights; float32's tiles take
# twice the registers: half the width), and its warps: at 256 and 4 warps ptxas spilled
# (96 bytes a thread in bf16, 22 KB in float32, at 255 registers); at 128 and 8 warps
# nothing spilled in bf16 (150-252 registers), nor in float32 at 64 with the table's code.
K_BLOCK = 128
GRU_WARPS = 8
E_BLOCK = 64  # correction-rank entries per step of a row's candidate products
# Padded batches up to this many requests take the GRU's input products of the nodes
# below the root from a table of their depth's candidates, filled at prepare (one GEMM):
# a pop then reads W_hh alone. Larger batches read W_ih once a pop for every row, which
# should cost less than the table, which grows with the rows (an estimate from bytes and
# FLOPs, docs/fused-build.md; `builder_bench.py --table-rows` measures it).
TABLE_ROWS = 2


@triton.jit
def _products(X, rows_live, W, unit, gate, w_stride, width, PRECISION: tl.constexpr,
              ROWS: tl.constexpr, UNITS: tl.constexpr, K: tl.constexpr):  # fmt: skip
    """X[rows, :width] @ W[g * gate + unit, :width]^T for the three gates g = 0, 1, 2
    -> three [ROWS, UNITS] float32. X: [ROWS] row pointers; unit:
    [UNITS] weight rows (-1: none). One pass over the reduction: each step loads the
    rows once and the gates' weight tiles together, contiguous along the reduction."""
    first = tl.zeros([ROWS, UNITS], dtype=tl.float32)
    second = tl.zeros([ROWS, UNITS], dtype=tl.float32)
    third = tl.zeros([ROWS, UNITS], dtype=tl.float32)
    k = tl.arange(0, K)
    for k0 in range(0, width, K):
        kk = k0 + k
        x = tl.load(X[:, None] + kk[None, :], mask=rows_live[:, None] & (kk < width)[None, :],
                    other=0.0)  # fmt: skip
        w = W + unit[:, None] * w_stride + kk[None, :]  # [UNITS, K]
        cols = (unit >= 0)[:, None] & (kk < width)[None, :]
        tile = tl.load(w, mask=cols, other=0.0)
        first = tl.dot(x, tl.trans(tile), first, input_precision=PRECISION)
        tile = tl.load(w + gate * w_stride, mask=cols, other=0.0)
        second = tl.dot(x, tl.trans(tile), second, input_precision=PRECISION)
        tile = tl.load(w + 2 * gate * w_stride, mask=cols, other=0.0)
        third = tl.dot(x, tl.trans(tile), third, input_precision=PRECISION)
    return first, second, third


@triton.jit
def _gru_gates(i_r, i_z, i_n, h_r, h_z, h_n, parent, node, j, live, G: tl.constexpr,
               States):  # fmt: skip
    """The GRU's gates (order r, z, n, as torch.nn.GRU's; no biases) from the six
    products [ROWS, UNITS] -> the new state, stored at the node's row of the table."""
    r = tl.sigmoid(i_r + h_r)
    z = tl.sigmoid(i_z + h_z)
    n = 2.0 * tl.sigmoid(2.0 * (i_n + r * h_n)) - 1.0  # tanh
    cell = live[:, None] & (j < G)[None, :]
    h = tl.load(parent[:, None] + j[None, :], mask=cell, other=0.0).to(tl.float32)
    new = tl.where(cell, (1.0 - z) * n + z * h, 0.0).to(States.dtype.element_ty)
    tl.store(node[:, None] + j[None, :], new, mask=cell)
    return new


@triton.jit
def _tabled_rows(Cand, Depth, p, token, req, live, cand_req_stride, cand_depth_stride,
                 M: tl.constexpr, M_PAD: tl.constexpr):  # fmt: skip
    """Which rows take their input products from the candidates' table (a node below the
    root whose token is one of its depth's candidates, cand[req, depth - 1]), at which
    candidate (the first equal one) and depth -> [ROWS] bool, int32, int64. (Computed
    where needed, not kept across the products: registers.)"""
    m = tl.arange(0, M_PAD)
    depth = tl.load(Depth + p, mask=live, other=0)
    above = tl.maximum(depth - 1, 0)
    at = Cand + req[:, None] * cand_req_stride + above[:, None] * cand_depth_stride + m[None, :]
    cands = tl.load(at, mask=live[:, None] & (m < M)[None, :], other=-1)
    hit = (cands == token[:, None]) & (depth >= 1)[:, None]
    tabled = live & (tl.max(hit.to(tl.int32), axis=1) > 0)
    return tabled, tl.min(tl.where(hit, m[None, :], M_PAD), axis=1), depth


@triton.jit
def _from_table(i_r, i_z, i_n, GI, Cand, Depth, p, token, req, live, unit, cand_req_stride,
                cand_depth_stride, gi_req_stride, gi_depth_stride, G: tl.constexpr,
                M: tl.constexpr, M_PAD: tl.constexpr):  # fmt: skip
    """The tabled rows' input products from GI [rows, K, M, 3G] (the others' kept)."""
    tabled, cand, depth = _tabled_rows(Cand, Depth, p, token, req, live, cand_req_stride,
                                       cand_depth_stride, M, M_PAD)  # fmt: skip
    above = tl.maximum(depth - 1, 0)
    row = GI + req * gi_req_stride + above * gi_depth_stride + cand * (3 * G)
    at = row[:, None] + unit[None, :]
    cell = tabled[:, None] & (unit >= 0)[None, :]
    i_r = tl.where(cell, tl.load(at, mask=cell, other=0.0).to(tl.float32), i_r)
    i_z = tl.where(cell, tl.load(at + G, mask=cell, other=0.0).to(tl.float32), i_z)
    i_n = tl.where(cell, tl.load(at + 2 * G, mask=cell, other=0.0).to(tl.float32), i_n)
    return i_r, i_z, i_n


@triton.jit
def _state_share(state, p, live, j, unit_block, W_s, UShares, w_s_stride, share_rows,
                 G: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr,
                 PRECISION: tl.constexpr):  # fmt: skip
    """The unit block's share of the correction's input, state[:, block] @ W_s[:, block]^T
    ([ROWS, UNITS] as stored, 0 past the rows) -> UShares[unit_block, p, :E] float32."""
    e = tl.arange(0, E_PAD)
    w = tl.load(W_s + e[:, None] * w_s_stride + j[None, :],
                mask=(e < E)[:, None] & (j < G)[None, :], other=0.0)  # fmt: skip
    share = tl.dot(state, tl.trans(w), input_precision=PRECISION)  # [ROWS, E_PAD]
    at = UShares + (unit_block * share_rows + p[:, None]) * E + e[None, :]
    tl.store(at, share, mask=live[:, None] & (e < E)[None, :])


# Row counts and the prefix length are not specialized on (Triton compiles a variant for
# a value of 1 or a multiple of 16): the builders' graphs compile one per kernel at start.
@triton.jit(do_not_specialize=["rows"])
def _gru_step(
    Tokens, Req, Parent, Node, Depth, Embed, States, W_ih, W_hh, Partials, Counters, W_s,
    UShares, Cand, GI,
    rows, partial_rows, embed_stride, state_req_stride, state_slot_stride, w_s_stride,
    share_rows, cand_req_stride, cand_depth_stride, gi_req_stride, gi_depth_stride,
    H: tl.constexpr, G: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr,
    PRECISION: tl.constexpr, ROWS: tl.constexpr, UNITS: tl.constexpr, K: tl.constexpr,
    SPLITS: tl.constexpr, H_SPLIT: tl.constexpr, G_SPLIT: tl.constexpr,
    M: tl.constexpr, M_PAD: tl.constexpr, FROM_TABLE: tl.constexpr,
):  # fmt: skip
    """Program (unit block, split, row block): the six products over the split's share
    of both reductions (H_SPLIT input columns, G_SPLIT state columns). With one split it
    applies the gates itself; with more, it stores its partial products, and the last
    of the unit block's splits to finish sums them in split order (the same sums on
    every launch: the builders' trees stay bit-identical) and applies the gates. Whoever
    applies the gates also stores the block's share of the correction's input."""
    unit_block = tl.program_id(0)
    split = tl.program_id(1)
    p = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
    live = p < rows
    token = tl.load(Tokens + p, mask=live, other=0)
    req = tl.load(Req + p, mask=live, other=0)
    state_row = req * state_req_stride
    parent = States + state_row + tl.load(Parent + p, mask=live, other=0) * state_slot_stride
    node = States + state_row + tl.load(Node + p, mask=live, other=0) * state_slot_stride
    j = unit_block * UNITS + tl.arange(0, UNITS)
    unit = tl.where(j < G, j, -1)  # a gate's rows; the next gate's are G further
    first_x, first_h = split * H_SPLIT, split * G_SPLIT
    x = Embed + token * embed_stride + first_x
    width_x = tl.minimum(H_SPLIT, H - first_x)
    width_h = tl.minimum(G_SPLIT, G - first_h)
    tabled = live & (p < 0)  # none
    if FROM_TABLE:
        tabled = _tabled_rows(Cand, Depth, p, token, req, live, cand_req_stride,
                              cand_depth_stride, M, M_PAD)[0]  # fmt: skip
    # The input products (W_ih's reads, two thirds of the weights) only where a row of
    # the block is not tabled (the root, a scratch row): else a reduction of no steps.
    untabled = tl.max((live & ~tabled).to(tl.int32), axis=0) > 0
    width_x = tl.where(untabled, width_x, 0)
    i_r, i_z, i_n = _products(x, live, W_ih + first_x, unit, G, H, width_x, PRECISION, ROWS,
                              UNITS, K)  # fmt: skip
    h_r, h_z, h_n = _products(parent + first_h, live, W_hh + first_h, unit, G, G, width_h,
                              PRECISION, ROWS, UNITS, K)  # fmt: skip
    if SPLITS == 1:
        if FROM_TABLE:
            i_r, i_z, i_n = _from_table(
                i_r, i_z, i_n, GI, Cand, Depth, p, token, req, live, unit, cand_req_stride,
                cand_depth_stride, gi_req_stride, gi_depth_stride, G, M, M_PAD,
            )  # fmt: skip
        new = _gru_gates(i_r, i_z, i_n, h_r, h_z, h_n, parent, node, j, live, G, States)
        _state_share(new, p, live, j, unit_block, W_s, UShares, w_s_stride, share_rows, G, E,
                     E_PAD, PRECISION)  # fmt: skip
    else:
        cell = live[:, None] & (j < G)[None, :]
        # Partials: [SPLITS, 6, partial_rows, G] float32
        at = Partials + (split * 6 * partial_rows + p[:, None]) * G + j[None, :]
        product = partial_rows * G
        tl.store(at, i_r, mask=cell)
        tl.store(at + product, i_z, mask=cell)
        tl.store(at + 2 * product, i_n, mask=cell)
        tl.store(at + 3 * product, h_r, mask=cell)
        tl.store(at + 4 * product, h_z, mask=cell)
        tl.store(at + 5 * product, h_n, mask=cell)
        # Every thread's stores are issued before the counter's release; the program
        # that counts last acquires them all.
        tl.debug_barrier()
        counter = Counters + tl.program_id(2) * tl.num_programs(0) + unit_block
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # for the next launch
            sums = Partials + p[:, None] * G + j[None, :]
            i_r = tl.zeros([ROWS, UNITS], dtype=tl.float32)
            i_z = tl.zeros([ROWS, UNITS], dtype=tl.float32)
            i_n = tl.zeros([ROWS, UNITS], dtype=tl.float32)
            h_r = tl.zeros([ROWS, UNITS], dtype=tl.float32)
            h_z = tl.zeros([ROWS, UNITS], dtype=tl.float32)
            h_n = tl.zeros([ROWS, UNITS], dtype=tl.float32)
            for s in range(SPLITS):
                part = sums + s * 6 * product
                i_r += tl.load(part, mask=cell, other=0.0)
                i_z += tl.load(part + product, mask=cell, other=0.0)
                i_n += tl.load(part + 2 * product, mask=cell, other=0.0)
                h_r += tl.load(part + 3 * product, mask=cell, other=0.0)
                h_z += tl.load(part + 4 * product, mask=cell, other=0.0)
                h_n += tl.load(part + 5 * product, mask=cell, other=0.0)
            if FROM_TABLE:
                i_r, i_z, i_n = _from_table(
                    i_r, i_z, i_n, GI, Cand, Depth, p, token, req, live, unit,
                    cand_req_stride, cand_depth_stride, gi_req_stride, gi_depth_stride, G, M,
                    M_PAD,
                )  # fmt: skip
            new = _gru_gates(i_r, i_z, i_n, h_r, h_z, h_n, parent, node, j, live, G, States)
            _state_share(new, p, live, j, unit_block, W_s, UShares, w_s_stride, share_rows, G,
                         E, E_PAD, PRECISION)  # fmt: skip


@triton.jit
def _correction_input(row, req, depth, UShares, HidPart, U, share_rows, hid_req_stride,
                      hid_depth_stride, E: tl.constexpr, E_PAD: tl.constexpr,
                      UNIT_BLOCKS: tl.constexpr):  # fmt: skip
    """u = silu(W_h h_d + W_s S) of one row: the GRU's unit blocks' shares of W_s S summed
    in block order (the same sums on every launch), into U [rows, E] float32."""
    e = tl.arange(0, E_PAD)
    valid = e < E
    acc = tl.zeros([E_PAD], dtype=tl.float32)
    for block in range(UNIT_BLOCKS):
        acc += tl.load(UShares + (block * share_rows + row) * E + e, mask=valid, other=0.0)
    hid = HidPart + req * hid_req_stride + depth * hid_depth_stride + e
    u = acc + tl.load(hid, mask=valid, other=0.0).to(tl.float32)
    tl.store(U + row * E + e, u * tl.sigmoid(u), mask=valid)
    tl.debug_barrier()  # every thread's share of u stored before any reads it back


@triton.jit
def _node_children(row, req, depth, U, ProjRows, Base, Cand, prefix_len, rows_req_stride,
                   rows_depth_stride, base_req_stride, base_depth_stride,
                   E: tl.constexpr, M: tl.constexpr, C: tl.constexpr, M_PAD: tl.constexpr,
                   C_PAD: tl.constexpr, E_STEP: tl.constexpr):  # fmt: skip
    """One row's children: the correction of its depth's M candidates by u (U [rows, E]
    float32, from _correction_input), the log-softmax, and the top C by rank (best first,
    equal values in candidate order: the first index among equal maxima, as argmax and
    the torch step's ranks give it) -> log-probs [C_PAD] float64 and token ids [C_PAD]
    (entries past C: 0)."""
    m = tl.arange(0, M_PAD)
    valid = m < M
    proj = ProjRows + req * rows_req_stride + depth * rows_depth_stride + m[:, None] * E
    corr = tl.zeros([M_PAD], dtype=tl.float32)
    for e0 in range(0, E, E_STEP):
        e = e0 + tl.arange(0, E_STEP)
        u = tl.load(U + row * E + e, mask=e < E, other=0.0)
        w = tl.load(proj + e[None, :], mask=valid[:, None] & (e < E)[None, :], other=0.0)
        corr += tl.sum(w.to(tl.float32) * u[None, :], axis=1)
    table = req * base_req_stride + depth * base_depth_stride  # this row's [M] entries
    base = tl.load(Base + table + m, mask=valid, other=0.0).to(tl.float32)
    logits = base + tl.where(depth >= prefix_len, corr, 0.0)
    logits = tl.where(valid, logits, float("-inf"))
    shifted = logits - tl.max(logits, axis=0)
    logprobs = shifted - tl.log(tl.sum(tl.exp(shifted), axis=0))
    # Each candidate's rank: how many come before it (higher, or equal and earlier). The
    # c-th child is the candidate of rank c: M x M comparisons in registers, where C
    # rounds of argmax each cost a reduction across the program's warps.
    mine, theirs = logprobs[:, None], logprobs[None, :]  # [M_PAD (i), M_PAD (j)]
    before = (theirs > mine) | ((theirs == mine) & (m[None, :] < m[:, None]))
    rank = tl.sum(before.to(tl.int32), axis=1)  # [M_PAD], a permutation of 0..M_PAD-1
    c = tl.arange(0, C_PAD)
    picked = (rank[None, :] == c[:, None]) & (c < C)[:, None]  # [C_PAD, M_PAD]
    values = tl.sum(tl.where(picked, logprobs[None, :], 0.0), axis=1)
    index = tl.sum(tl.where(picked, m[None, :], 0), axis=1)
    tokens = tl.load(Cand + table + index, mask=c < C, other=0)
    return values.to(tl.float64), tokens


@triton.jit(
    do_not_specialize=["prefix_len", "budget", "max_depth", "max_branches", "state_scratch"]
)
def _children(
    Req, Node, Depth, UShares, HidPart, U, ProjRows, Base, Cand, Values, Tokens,
    share_rows, hid_req_stride, hid_depth_stride,
    prefix_len, rows_req_stride, rows_depth_stride, base_req_stride, base_depth_stride,
    Expand, Trees, Parents, Depths, Scores, ChildLogprobs, ChildTokens, NextRank, PushSeq,
    Count, SpineTip, Branches, RecordSeq, PopSeq, OutNode, OutParent, OutToken, OutDepth,
    OutExpand, width, budget, max_depth, max_branches, state_scratch,
    E: tl.constexpr, E_PAD: tl.constexpr, UNIT_BLOCKS: tl.constexpr, M: tl.constexpr,
    C: tl.constexpr, M_PAD: tl.constexpr, C_PAD: tl.constexpr, E_STEP: tl.constexpr,
    POP: tl.constexpr, WIDTH: tl.constexpr,
):  # fmt: skip
    """Program per row: u from the GRU step's shares (_correction_input), then the
    children of the row's node. Without POP they are stored (Values [rows, C] float64,
    Tokens [rows, C]: the host heap's call); with POP they go straight into the device
    builder's pop on the row's frontier (kernels/tree_pop.py; Expand, the frontier and
    Out*), which writes the next pop's step inputs. Both compile the same children code,
    so both builders see the same children."""
    row = tl.program_id(0)
    req = tl.load(Req + row)
    depth = tl.load(Depth + row)
    _correction_input(row, req, depth, UShares, HidPart, U, share_rows, hid_req_stride,
                      hid_depth_stride, E, E_PAD, UNIT_BLOCKS)  # fmt: skip
    values, tokens = _node_children(
        row, req, depth, U, ProjRows, Base, Cand, prefix_len, rows_req_stride,
        rows_depth_stride, base_req_stride, base_depth_stride, E, M, C, M_PAD, C_PAD, E_STEP,
    )  # fmt: skip
    c = tl.arange(0, C_PAD)
    if POP:
        file_and_pop(
            row, tl.load(Node + row), tl.load(Expand + row) != 0, values, tokens, c, Trees,
            Parents, Depths, Scores, ChildLogprobs, ChildTokens, NextRank, PushSeq, Count,
            SpineTip, Branches, RecordSeq, PopSeq, OutNode, OutParent, OutToken, OutDepth,
            OutExpand, width, width - 1, C, budget, max_depth, max_branches, state_scratch,
            WIDTH,
        )  # fmt: skip
    else:
        tl.store(Values + row * C + c, values, mask=c < C)
        tl.store(Tokens + row * C + c, tokens, mask=c < C)


class DominoStep:
    """The conditional scorer's per-node step as two launches (CUDA, restricted to the
    top-M candidates): `gru` (with its shares of u), then `children` (u, then the
    children, which may end with the device builder's pop). Buffers and weights are the
    scorer's own; a call of the step itself writes the nodes' states and returns the
    children (log-probs [p, C] float64, tokens [p, C])."""

    def __init__(self, scorer, max_rows: int):
        head = scorer.head
        self.scorer = scorer
        self.w_ih, self.w_hh = head.w_ih.contiguous(), head.w_hh.contiguous()
        self.w_s = scorer.w_state  # [E, G], a view of embed_proj.0 (row stride H + G)
        self.hidden, self.gru_units = head.w_ih.shape[1], head.w_hh.shape[1]
        self.rank = self.w_s.shape[0]
        self.e_pad = max(16, triton.next_power_of_2(self.rank))  # for a tensor-core product
        # float32 drafters multiply in IEEE float32 (tensor cores would round to TF32)
        self.precision = "ieee" if head.w_ih.dtype == torch.float32 else "tf32"
        self.k_block = gru_k_block(head.w_ih.dtype)
        device = head.w_ih.device
        c = scorer.max_children
        self.u = torch.zeros(max_rows, self.rank, device=device, dtype=torch.float32)
        # Each GRU unit block's share of u per row: [unit blocks, max_rows, E] float32.
        self.unit_blocks = triton.cdiv(self.gru_units, UNITS_BLOCK)
        self.max_rows = max_rows
        self.u_shares = torch.zeros(
            self.unit_blocks, max_rows, self.rank, device=device, dtype=torch.float32
        )
        # The GRU step's split reduction: partial products of up to MAX_SPLITS splits of
        # one row block, or of one split of every row block; a counter per (row block,
        # unit block), zero between launches.
        row_blocks = triton.cdiv(max_rows, ROWS_BLOCK)
        self.partial_rows = max(MAX_SPLITS, row_blocks) * ROWS_BLOCK
        self.partials = torch.zeros(6 * self.partial_rows, self.gru_units, device=device)
        self.counters = torch.zeros(row_blocks * self.unit_blocks, device=device, dtype=torch.int32)
        # The candidates' input products, gi[r, k, m] = E[cand[r, k, m]] W_ih^T, [rows, K,
        # M, 3G] in the head's dtype, for padded batches of up to TABLE_ROWS (fill_table).
        table_rows = min(TABLE_ROWS, scorer.max_requests)
        self.gi = torch.zeros(
            table_rows, *scorer.cand.shape[1:], 3 * self.gru_units, device=device,
            dtype=head.w_ih.dtype,
        )  # fmt: skip
        self.values = torch.zeros(max_rows, c, device=device, dtype=torch.float64)
        self.tokens = torch.zeros(max_rows, c, device=device, dtype=torch.long)
        # Domino's chain (`chain`): each draft's fixed rows, (request, node = depth d,
        # parent d - 1, the root's the zero slot) [K, 3, max_rows], and the path's tokens
        # [K + 1, max_rows] (the anchors, then each draft) and log-probs [K, max_rows],
        # which the two launches of a draft read and write in place.
        k = scorer.hid_part.shape[1]
        depths = torch.arange(k, device=device)[:, None].expand(k, max_rows)
        self.chain_rows = torch.stack(
            [torch.arange(max_rows, device=device).expand(k, max_rows), depths, depths - 1], 1
        )
        self.chain_rows[0, 2] = scorer.zero_slot
        self.chain_tokens = torch.zeros(k + 1, max_rows, device=device, dtype=torch.long)
        self.chain_logprobs = torch.zeros(k, max_rows, device=device, dtype=torch.float64)
        # The kernels index the scorer's tables by their strides, the candidates' with the
        # base logits' (the same [R, K, M] shape).
        tables = (scorer.proj_rows, scorer.base, scorer.cand, scorer.states, scorer.hid_part)
        assert all(t.is_contiguous() for t in tables) and scorer.cand.shape == scorer.base.shape
        assert self.w_s.stride(1) == 1 and scorer.embed_tokens.stride(1) == 1

    def __call__(self, req, node, parent, token, depth) -> tuple[torch.Tensor, torch.Tensor]:
        """[p] rows each (the scorer's `children`): the nodes' states, then their children."""
        req, node, depth = (t.contiguous() for t in (req, node, depth))
        self.gru(req, node, parent, token, depth)
        self.children(req, node, depth)
        p = req.shape[0]
        return self.values[:p], self.tokens[:p]

    def chain(self, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Domino's chain for [p] requests (the scorer's `chain` on this step): per draft
        the step's two launches, the very calls the host heap makes for the path's node,
        on rows and into outputs that stay in place (no per-draft column stack or
        copies). -> drafts [p, K] and their log-probs [p, K] float64, views of this
        step's buffers until its next chain."""
        assert self.values.shape[1] == 1, "a chain takes one child per node"
        p = anchors.shape[0]
        path = self.chain_tokens
        path[0, :p] = anchors
        for d in range(self.chain_rows.shape[0]):
            req, node, parent = self.chain_rows[d, :, :p]
            self.gru(req, node, parent, path[d, :p], node)  # node d sits at depth d
            self.children(req, node, node, into=(self.chain_logprobs[d], path[d + 1]))
        return path[1:, :p].T, self.chain_logprobs[:, :p].T

    def gru(self, req, node, parent, token, depth) -> None:
        """States[req, node] = GRU(embed[token], states[req, parent]) for [p] rows (at
        their depths), and each unit block's share of the rows' u (self.u_shares, read by
        `children`). In a step of up to TABLE_ROWS padded requests, the rows whose token
        is one of their depth's candidates take embed[token] W_ih^T from the table."""
        req, node, parent, token, depth = (
            t.contiguous() for t in (req, node, parent, token, depth)
        )
        s = self.scorer
        p = req.shape[0]
        states = s.states
        splits = self.splits(p)
        _gru_step[(self.unit_blocks, splits, triton.cdiv(p, ROWS_BLOCK))](
            token, req, parent, node, depth, s.embed_tokens, states, self.w_ih, self.w_hh,
            self.partials, self.counters, self.w_s, self.u_shares, s.cand, self.gi,
            p, self.partial_rows // splits, s.embed_tokens.stride(0), states.stride(0),
            states.stride(1), self.w_s.stride(0), self.max_rows, s.cand.stride(0),
            s.cand.stride(1), self.gi.stride(0), self.gi.stride(1),
            H=self.hidden, G=self.gru_units, E=self.rank, E_PAD=self.e_pad,
            PRECISION=self.precision,
            ROWS=ROWS_BLOCK, UNITS=UNITS_BLOCK, K=self.k_block, SPLITS=splits,
            num_warps=GRU_WARPS, H_SPLIT=split_width(self.hidden, splits, self.k_block),
            G_SPLIT=split_width(self.gru_units, splits, self.k_block),
            M=s.width, M_PAD=triton.next_power_of_2(s.width), FROM_TABLE=self.tabled(p),
        )  # fmt: skip

    def tabled(self, p: int) -> bool:
        """Whether the GRU launches of a step of p padded requests read the candidates'
        table (fill_table). Decided by the launch's own rows, not by the scorer's last
        prepare: a builder's graphs are captured for every padded batch size after any
        prepare (or none), and each must read the table only when its size fills one."""
        return p <= self.gi.shape[0]

    def fill_table(self, n: int) -> None:
        """The candidates' input products of a step's n requests (after the scorer's
        prepare has written their candidates), when the step takes them from the table."""
        if self.tabled(self.scorer.step_rows):
            cand = self.scorer.cand[:n]  # [n, K, M] token ids
            # In the head's dtype: a bf16 table rounds gi as the torch step does (the
            # kernel's own products keep float32), a float32 one is IEEE.
            self.gi[:n] = self.scorer.embed_tokens[cand].to(self.w_ih.dtype) @ self.w_ih.T

    def children(
        self,
        req,
        node,
        depth,
        pop: PopTables | None = None,
        into: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """The children of [p] rows' nodes (contiguous; states and u's shares written by
        `gru`), one launch: u, the correction, the top C and, with `pop`, the device
        builder's pop on its frontier (kernels/tree_pop.py); without it, the children's
        log-probs and tokens into `into` ([>= p, C] each, contiguous rows), by default
        self.values / self.tokens."""
        s = self.scorer
        p = req.shape[0]
        c = s.max_children
        # Without the pop its pointers are never read: any tensors stand in.
        frontier = pop.frontier if pop else (self.values,) * 11
        seqs = (pop.record_seq, pop.pop_seq) if pop else (self.tokens,) * 2
        out = pop.out if pop else (self.tokens,) * 5
        width = frontier[0].shape[1]
        values, tokens = into or (self.values, self.tokens)
        _children[(p,)](
            req, node, depth, self.u_shares, s.hid_part, self.u, s.proj_rows, s.base, s.cand,
            values, tokens, self.max_rows, s.hid_part.stride(0), s.hid_part.stride(1),
            s.prefix_len, s.proj_rows.stride(0), s.proj_rows.stride(1), s.base.stride(0),
            s.base.stride(1),
            pop.expand if pop else node, *frontier, *seqs, *out,
            width, pop.budget if pop else 0, pop.max_depth if pop else 0,
            pop.max_branches if pop else 0, s.scratch_slot,
            E=self.rank, E_PAD=self.e_pad, UNIT_BLOCKS=self.unit_blocks, M=s.width, C=c,
            M_PAD=triton.next_power_of_2(s.width), C_PAD=triton.next_power_of_2(c),
            E_STEP=min(E_BLOCK, triton.next_power_of_2(self.rank)),
            POP=pop is not None, WIDTH=triton.next_power_of_2(width),
        )  # fmt: skip

    def splits(self, p: int) -> int:
        """Splits of the GRU step's reduction for p rows: enough programs to fill the GPU
        (a power of two, at most MAX_SPLITS, each with a step's width of the input), one
        once the row blocks alone do. A function of p only: fixed in a captured graph,
        and the same for both builders."""
        programs = triton.cdiv(self.gru_units, UNITS_BLOCK) * triton.cdiv(p, ROWS_BLOCK)
        wanted = min(
            MAX_SPLITS, triton.cdiv(GRU_PROGRAMS, programs), triton.cdiv(self.hidden, self.k_block)
        )
        splits = 1
        while (
            splits * 2 <= wanted
            and splits * 2 * triton.cdiv(p, ROWS_BLOCK) * ROWS_BLOCK <= self.partial_rows
        ):
            splits *= 2
        return splits


@dataclass
class PopTables:
    """What the children kernel needs to end with the device builder's pop: the [p] rows'
    frontier (tokens, parents, depths, scores [p, width], child log-probs and tokens
    [p, width, C], next_rank, push_seq [p, width], count, spine_tip, branches [p];
    contiguous), whether each row's node expands, the two pushes' sequence numbers ([]
    long), the next step's inputs to write (node, parent, token, depth [p] long, expand
    [p] bool) and the tree's limits (TreeShape's budget, max_depth, max_branches)."""

    frontier: tuple[torch.Tensor, ...]
    expand: torch.Tensor
    record_seq: torch.Tensor
    pop_seq: torch.Tensor
    out: tuple[torch.Tensor, ...]
    budget: int
    max_depth: int
    max_branches: int


def gru_k_block(dtype: torch.dtype) -> int:
    """The GRU's reduction step for weights of `dtype` (K_BLOCK's comment)."""
    return K_BLOCK if dtype.itemsize == 2 else K_BLOCK // 2


def split_width(width: int, splits: int, k_block: int) -> int:
    """Each split's share of a reduction, in whole steps of k_block."""
    return triton.cdiv(triton.cdiv(width, splits), k_block) * k_block
