"""A step's tree acceptance and its counters in one launch (Triton): one program per request.

engine/acceptance.py states the rule and keeps it in torch (accept_trees, step_counters:
about 85 small kernels, 0.14 ms of a batch-1 round on the H200 even as one graph replay,
benchmarks/results/h200_2026-12-05b). Here each request's program holds its logits rows
(at most 1 + budget, contiguous: rows last_rows[r - 1] + 1 .. last_rows[r]) in registers
and computes the same results: the matched rows, the first match among siblings, the
accepted path, the bonus row, the rejection sampler's layout and the step's counters.
The torch functions stay the reference (CPU, and the tests: equal outputs on random
steps).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

COUNTERS = 4  # acceptance.step_counters's: accepted, sibling accepts, moved paths, leaves
_COUNTERS = tl.constexpr(COUNTERS)  # the kernel's copy (a jit function reads constexpr globals)


# The width and row count vary from step to step (a sampled step runs eagerly with its
# widest tree's width): not specialized on, so that no step compiles a new variant
# after the accept graphs compiled theirs at engine start.
@triton.jit(do_not_specialize=["num_logits", "W"])
def _accept_request(
    ParentRow,  # [L] int64 per logits row (tree_step.TreeStep's fields)
    Token,
    Ancestors,
    Siblings,
    Offset,
    Depth,
    InTree,
    Target,  # [>= L] int64: the target's token at every logits row
    LastRows,  # [R] int64: each request's last logits row
    Sampled,  # [R, W] int32 out: path tokens, the bonus, -1 after
    Path,  # [R, W] int64 out: the path's row offsets, -1 after
    NumAccepted,  # [R] int64 out
    Accepted,  # [L] int8 out (zeroed by the caller: rows of no request stay 0)
    Counters,  # [R, COUNTERS] int64 out, per request (summed by the caller)
    num_logits,
    W,
    BLOCK: tl.constexpr,  # a power of two >= W (block_for)
):
    r = tl.program_id(0)
    last = tl.load(LastRows + r)
    first = tl.load(LastRows + r - 1, mask=r > 0, other=-1) + 1
    j = first + tl.arange(0, BLOCK)  # the request's logits rows
    valid = (j <= last) & (j < num_logits)
    parent = tl.load(ParentRow + j, mask=valid, other=-1)
    token = tl.load(Token + j, mask=valid, other=-1)
    ancestors = tl.load(Ancestors + j, mask=valid, other=0)
    siblings = tl.load(Siblings + j, mask=valid, other=0)
    offset = tl.load(Offset + j, mask=valid, other=0)
    depth = tl.load(Depth + j, mask=valid, other=0)
    tree_row = tl.load(InTree + j, mask=valid, other=0) != 0

    # A row matches when its token is the one the target drew at its parent; its own
    # bit is bit offset - 1 (the request's bits are disjoint: OR is a sum).
    drawn_at_parent = tl.load(Target + tl.maximum(parent, 0), mask=valid & (parent >= 0), other=-2)
    match = valid & (parent >= 0) & (token == drawn_at_parent)
    own = tl.where(offset >= 1, tl.full([BLOCK], 1, tl.int64) << tl.maximum(offset - 1, 0), 0)
    matched = tl.sum(tl.where(match, own, 0), axis=0)
    first_match = match & ((matched & siblings) == 0)  # no earlier sibling matched
    good = tl.sum(tl.where(first_match, own, 0), axis=0)
    accepted = valid & tree_row & (offset >= 1) & ((good & ancestors) == ancestors)

    # The bonus row: the deepest accepted row, else the tree's root, else the last row.
    root_row = tl.max(tl.where(valid & tree_row & (offset == 0), j, -1), axis=0)
    stop = tl.where(root_row >= 0, root_row, last)
    stop = tl.maximum(stop, tl.max(tl.where(accepted, j, -1), axis=0))
    num_accepted = tl.sum(accepted.to(tl.int64), axis=0)
    bonus = tl.load(Target + stop)

    # The rejection sampler's layout: -1 everywhere, then accepted row i at column
    # depth - 1 (the path's depths are 1 .. k) and the bonus at column k. The barrier
    # orders the fill before the scatter (other threads write the same addresses).
    column = tl.arange(0, BLOCK)
    in_width = column < W
    tl.store(Sampled + r * W + column, tl.full([BLOCK], -1, tl.int32), mask=in_width)
    tl.store(Path + r * W + column, tl.full([BLOCK], -1, tl.int64), mask=in_width)
    tl.debug_barrier()
    tl.store(Sampled + r * W + depth - 1, token.to(tl.int32), mask=accepted)
    tl.store(Path + r * W + depth - 1, offset, mask=accepted)
    tl.store(Sampled + r * W + num_accepted, bonus.to(tl.int32))
    tl.store(NumAccepted + r, num_accepted)
    tl.store(Accepted + j, accepted.to(tl.int8), mask=valid)

    # Counters: sibling accepts, a path that is not rows 1..k (its K/V moves), leaves:
    # a drafted node none of whose tree's rows descends from it (its bit in no other
    # node's ancestor bits), and the root when the tree has no drafted node.
    sibling = tl.sum((accepted & (siblings != 0)).to(tl.int64), axis=0)
    moved = tl.max((accepted & (offset != depth)).to(tl.int64), axis=0)
    drafted = valid & tree_row & (parent >= 0)
    inner = tl.reduce(tl.where(drafted, ancestors & ~own, 0), 0, _bitwise_or)
    leaves = tl.sum((drafted & ((inner & own) == 0)).to(tl.int64), axis=0)
    has_root = root_row >= 0
    leaves += (has_root & (tl.sum(drafted.to(tl.int32), axis=0) == 0)).to(tl.int64)
    tl.store(Counters + r * _COUNTERS + 0, num_accepted)
    tl.store(Counters + r * _COUNTERS + 1, sibling)
    tl.store(Counters + r * _COUNTERS + 2, moved)
    tl.store(Counters + r * _COUNTERS + 3, leaves)


@triton.jit
def _bitwise_or(a, b):
    return a | b


def block_for(width: int) -> int:
    """The kernel's row block for a width: one variant for every width up to 32 (the
    default budget's 17), and the next power of two beyond."""
    return max(32, triton.next_power_of_2(width))


def accept_requests(
    parent_row: torch.Tensor,  # [L] long, and the other TreeStep fields below
    token: torch.Tensor,
    ancestors: torch.Tensor,
    siblings_before: torch.Tensor,
    offset: torch.Tensor,
    depth: torch.Tensor,
    in_tree: torch.Tensor,
    target: torch.Tensor,  # [>= L] long
    last_rows: torch.Tensor,  # [R] long
    width: int,  # W
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> sampled [R, W] int32, path offsets [R, W] long, num_accepted [R] long,
    accepted [L] bool, counters [COUNTERS] long (acceptance.accept_trees' and
    step_counters' results)."""
    num_reqs, num_logits = last_rows.shape[0], parent_row.shape[0]
    device = target.device
    sampled = torch.empty(num_reqs, width, dtype=torch.int32, device=device)
    path = torch.empty(num_reqs, width, dtype=torch.long, device=device)
    num_accepted = torch.empty(num_reqs, dtype=torch.long, device=device)
    accepted = torch.zeros(num_logits, dtype=torch.int8, device=device)
    counters = torch.empty(num_reqs, COUNTERS, dtype=torch.long, device=device)
    _accept_request[(num_reqs,)](
        parent_row,
        token,
        ancestors,
        siblings_before,
        offset,
        depth,
        in_tree,
        target,
        last_rows,
        sampled,
        path,
        num_accepted,
        accepted,
        counters,
        num_logits,
        width,
        BLOCK=block_for(width),
    )
    return sampled, path, num_accepted, accepted.bool(), counters.sum(0)
