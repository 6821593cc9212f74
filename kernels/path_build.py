"""A step's FA3 path requests (engine/tree_paths.py) built from its description on the
device, in two launches: nothing waits for the GPU, and the host's work does not grow
with the batch.

Per tree (W rows: the root, then drafted rows with ancestor bits), the same layout as
the host's `PathTables.publish`: a leaf's path is its ancestors and itself; a row that
needs a fix (EVERY_ROW: every row, the root included) belongs to the first leaf below
it; a leaf whose path owns rows becomes a path request, requests in tree order and each
tree's in leaf order, their queries the owned rows in row order. `_count_paths` (one
program per tree) counts each tree's requests and queries; `_fill_paths` (one program
per tree and leaf) places its request after the earlier trees' (the counts summed in
each program: trees <= a few hundred) and writes its key count, query start, queries
and slots: the prefix's, from the block table, then its path's nodes'. One compilation
serves every step of an engine (the runner makes it at start: engine/runner.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KEY_BLOCK = 128  # slot-table entries written per step of a request's prefix loop
TREE_BLOCK = 64  # trees' counts summed per step


@triton.jit
def _tree_paths(
    Trees, stride_field, Ancestors, NeedsFix, tree, W_PAD: tl.constexpr, EVERY_ROW: tl.constexpr
):
    """Tree `tree`'s rows [W] and, over leaves L and rows j: on_path[L, j] (row j, j >= 1,
    is row L or one of its ancestors, L a leaf) and owns[L, j] (j needs a fix and L is
    the first leaf whose path holds it). EVERY_ROW: every row needs it, and every path
    holds the root (j = 0; the root alone is a leaf of a tree of one row)."""
    first = tl.load(Trees + tree)
    count = tl.load(Trees + stride_field + tree)
    offs = tl.arange(0, W_PAD)
    valid = offs < count
    rows = first + offs
    bits = tl.load(Ancestors + rows, mask=valid, other=0)
    fix = valid & (tl.load(NeedsFix + rows, mask=valid, other=0) != 0)
    shift = tl.minimum(tl.maximum(offs - 1, 0), 63).to(tl.int64)  # row j owns bit j - 1
    holds = (((bits[:, None] >> shift[None, :]) & 1) != 0) & (valid & (offs >= 1))[None, :]
    candidate = valid & (offs >= 1)  # leaves: rows below no other row
    if EVERY_ROW:
        fix = valid
        holds = holds | (valid[:, None] & (offs == 0)[None, :])
        candidate = valid
    below = tl.max((holds & (offs[:, None] != offs[None, :])).to(tl.int32), axis=0)
    leaf = candidate & (below == 0)
    on_path = holds & leaf[:, None]
    owner = tl.min(tl.where(on_path, offs[:, None], W_PAD), axis=0)  # [j]: first leaf
    owns = on_path & fix[None, :] & (owner[None, :] == offs[:, None])
    return rows, on_path, owns


@triton.jit
def _count_paths(
    Trees, stride_field, Ancestors, NeedsFix, Counts, W_PAD: tl.constexpr, EVERY_ROW: tl.constexpr
):
    tree = tl.program_id(0)
    _, _, owns = _tree_paths(Trees, stride_field, Ancestors, NeedsFix, tree, W_PAD, EVERY_ROW)
    owned = tl.sum(owns.to(tl.int32), axis=1)  # [L]
    tl.store(Counts + 2 * tree, tl.sum((owned > 0).to(tl.int32)))
    tl.store(Counts + 2 * tree + 1, tl.sum(owned))


@triton.jit
def _earlier(Counts, tree, num_trees, TREE_BLOCK: tl.constexpr):
    """(path requests, queries) of the trees before `tree`, and of all trees."""
    paths_before = tl.zeros([], dtype=tl.int32)
    queries_before = tl.zeros([], dtype=tl.int32)
    paths_all = tl.zeros([], dtype=tl.int32)
    queries_all = tl.zeros([], dtype=tl.int32)
    for t0 in range(0, num_trees, TREE_BLOCK):
        t = t0 + tl.arange(0, TREE_BLOCK)
        paths_of = tl.load(Counts + 2 * t, mask=t < num_trees, other=0)
        queries_of = tl.load(Counts + 2 * t + 1, mask=t < num_trees, other=0)
        paths_before += tl.sum(tl.where(t < tree, paths_of, 0))
        queries_before += tl.sum(tl.where(t < tree, queries_of, 0))
        paths_all += tl.sum(paths_of)
        queries_all += tl.sum(queries_of)
    return paths_before, queries_before, paths_all, queries_all


# The runtime sizes are not specialized on (Triton compiles a variant for a value of 1 or
# a multiple of 16): the runner compiles these once at engine start, not on a request.
@triton.jit(do_not_specialize=["num_trees", "max_paths", "page_size"])
def _fill_paths(
    Trees,
    stride_field,
    Ancestors,
    NeedsFix,
    Positions,
    BlockTable,
    stride_table,
    SlotMapping,
    Counts,
    SlotTable,
    stride_slots,
    SeqUsed,
    QueryStart,
    QueryRows,
    RowOwned,
    RowToQuery,
    num_trees,
    max_paths,
    page_size,
    W_PAD: tl.constexpr,
    TREE_BLOCK: tl.constexpr,
    KEY_BLOCK: tl.constexpr,
    EVERY_ROW: tl.constexpr,
):
    tree = tl.program_id(0)
    leaf = tl.program_id(1)
    if leaf >= tl.load(Trees + stride_field + tree) and (tree + leaf) > 0:
        return  # no such row (program (0, 0) always has entries to fill)
    rows, on_path, owns = _tree_paths(
        Trees, stride_field, Ancestors, NeedsFix, tree, W_PAD, EVERY_ROW
    )
    owned = tl.sum(owns.to(tl.int32), axis=1)  # [L]
    paths_before, queries_before, paths_all, queries_all = _earlier(
        Counts, tree, num_trees, TREE_BLOCK
    )
    if tree == 0 and leaf == 0:  # the entries past the last request: every query
        for e in range(paths_all, max_paths + 1, KEY_BLOCK):
            entry = e + tl.arange(0, KEY_BLOCK)
            tl.store(QueryStart + entry, queries_all, mask=entry <= max_paths)
    offs = tl.arange(0, W_PAD)
    mine = offs == leaf
    if tl.sum(tl.where(mine, owned, 0)) == 0:
        return
    earlier = offs < leaf
    path = paths_before + tl.sum((earlier & (owned > 0)).to(tl.int32))
    start = queries_before + tl.sum(tl.where(earlier, owned, 0))
    # [j] this path's nodes after the root (the root is the prefix's last key)
    nodes = (tl.max((on_path & mine[:, None]).to(tl.int32), axis=0) != 0) & (offs >= 1)
    queries = tl.max((owns & mine[:, None]).to(tl.int32), axis=0) != 0  # [j] owned here
    first = tl.load(Trees + tree)
    root = tl.load(Positions + first)
    tl.store(SeqUsed + path, (root + 1 + tl.sum(nodes.to(tl.int32))).to(tl.int32))
    tl.store(QueryStart + path, start.to(tl.int32))
    query = start + tl.cumsum(queries.to(tl.int32), axis=0) - 1
    tl.store(QueryRows + query, rows, mask=queries)
    tl.store(RowOwned + rows, tl.full([W_PAD], 1, tl.int1), mask=queries)
    tl.store(RowToQuery + rows, query.to(tl.int64), mask=queries)
    # Keys: the prefix up to the root (pages of the request's block table), then the
    # path's nodes at root + depth.
    slots = SlotTable + path.to(tl.int64) * stride_slots
    request = tl.load(Trees + 2 * stride_field + tree)
    for k in range(0, root + 1, KEY_BLOCK):
        key = k + tl.arange(0, KEY_BLOCK)
        inside = key <= root
        page = tl.load(BlockTable + request * stride_table + key // page_size, mask=inside)
        tl.store(slots + key, (page * page_size + key % page_size).to(tl.int32), mask=inside)
    key = root + tl.cumsum(nodes.to(tl.int32), axis=0)
    node_slot = tl.load(SlotMapping + rows, mask=nodes, other=0)
    tl.store(slots + key, node_slot.to(tl.int32), mask=nodes)


def build_path_requests(
    trees: torch.Tensor,  # [3, K] long: per tree its root row, its rows, its batch row
    rows_per_tree: int,  # W
    ancestors: torch.Tensor,  # [>= T] per forward row
    needs_fix: torch.Tensor,  # [>= T]
    positions: torch.Tensor,  # [>= T] (a root row: the root's position)
    block_table: torch.Tensor,  # [max_reqs, max_blocks] int32
    block_size: int,
    slot_mapping: torch.Tensor,  # [>= T] each forward row's slot
    counts: torch.Tensor,  # [>= 2K] int32 scratch
    slot_table: torch.Tensor,  # [max_paths, max_len] int32
    seq_used: torch.Tensor,  # [max_paths] int32, zero past the step's requests
    query_start: torch.Tensor,  # [max_paths + 1] int32
    query_rows: torch.Tensor,  # [max_tokens] long
    row_owned: torch.Tensor,  # [max_tokens] bool, False where not written
    row_to_query: torch.Tensor,  # [max_tokens] long
    every_row: bool = False,  # every row a query (the root with its tree's first path)
) -> None:
    num_trees = trees.shape[1]
    w_pad = triton.next_power_of_2(rows_per_tree)
    _count_paths[(num_trees,)](
        trees, trees.stride(0), ancestors, needs_fix, counts, W_PAD=w_pad, EVERY_ROW=every_row
    )
    _fill_paths[(num_trees, w_pad)](
        trees,
        trees.stride(0),
        ancestors,
        needs_fix,
        positions,
        block_table,
        block_table.stride(0),
        slot_mapping,
        counts,
        slot_table,
        slot_table.stride(0),
        seq_used,
        query_start,
        query_rows,
        row_owned,
        row_to_query,
        num_trees,
        seq_used.shape[0],
        block_size,
        W_PAD=w_pad,
        TREE_BLOCK=TREE_BLOCK,
        KEY_BLOCK=KEY_BLOCK,
        EVERY_ROW=every_row,
    )
