"""The device builder's pop (tree/device_builder.py) for one request, as a Triton
function that the node step's children kernel (kernels/domino_step.py) ends with: it
files the last new node's children, which that kernel has just computed, and pops the
request's next node.

The torch version (`DeviceTreeBuilder._advance_rows`, compiled by Inductor) is the
reference; this is the same arithmetic on the same tables: the float64 offers (a slot's
score plus its next child's log-prob), the best offer with the earliest push among
equal ones, the owed spine child first, the popped node filed, its parent's next child
offered; past the tree's `max_branches` pops of a later child, first children only. A
request's frontier is one tree's slots (the budget + 2 of them), so a program
holds its rows in registers: it reads each table row once, applies the filing and the
pop there, and writes the rows back once (no store is read back within the program).

It also gives the next pop's scorer step its inputs, as the torch version does: the new
node, or the scorer's scratch state slot where nothing expands, and its depth (0 there).
With the Triton node step a pop is then two launches: the GRU (with its shares of u),
and u with the children and this pop.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def file_and_pop(r, new_node, new_expanded, new_logprobs, new_tokens, c,
                 Tokens, Parents, Depths, Scores, ChildLogprobs, ChildTokens, NextRank, PushSeq,
                 Count, SpineTip, Branches, RecordSeq, PopSeq, OutNode, OutParent, OutToken,
                 OutDepth, OutExpand, width, slots, children, budget, max_depth, max_branches,
                 state_scratch, WIDTH: tl.constexpr):  # fmt: skip
    """Request r: the children of its new node `new_node` (a scalar; `new_expanded`
    False: it expands nothing, and they go to the scratch slot), `new_logprobs` [CHILDREN]
    float64 and `new_tokens` [CHILDREN] best first (entries c >= children unused),
    filed; then one pop. Row r's tables: [width] Tokens .. PushSeq (width = slots + 1,
    the last the scratch slot), [width, children] ChildLogprobs / ChildTokens; Out*: [p]
    the next step's inputs."""
    j = tl.arange(0, WIDTH)
    in_row = j < width
    tree = j < slots  # the tree's slots (the scratch slot offers nothing)
    in_children = c < children
    base = r.to(tl.int64) * width
    child_base = base * children

    # File the new node's children (the scratch slot where it expands nothing).
    slot = tl.where(new_expanded, new_node, slots)
    tl.store(ChildLogprobs + child_base + slot * children + c, new_logprobs, mask=in_children)
    tl.store(ChildTokens + child_base + slot * children + c, new_tokens, mask=in_children)
    spine_tip = tl.load(SpineTip + r)
    # The spine's next node is popped without a push: nothing offered from it.
    filed_rank = tl.where(spine_tip == new_node, children, 0)
    next_rank = tl.load(NextRank + base + j, mask=in_row, other=children)
    next_rank = tl.where(j == slot, filed_rank, next_rank)
    push_seq = tl.load(PushSeq + base + j, mask=in_row, other=0)
    push_seq = tl.where(j == slot, tl.load(RecordSeq), push_seq)

    # The pop: the best offer (ties: the earliest push), or the owed spine child; past
    # its branches, the row offers first children only.
    scores = tl.load(Scores + base + j, mask=in_row, other=0.0)
    branches = tl.load(Branches + r)
    offered = tree & (next_rank < children) & ((next_rank == 0) | (branches < max_branches))
    rank = tl.minimum(next_rank, children - 1)
    stored = tl.load(ChildLogprobs + child_base + j * children + rank, mask=tree & (j != slot),
                     other=0.0)  # fmt: skip
    slot_rank = tl.minimum(filed_rank, children - 1)
    filed = tl.sum(tl.where(c == slot_rank, new_logprobs, 0.0), axis=0)
    offer = tl.where(offered, scores + tl.where(j == slot, filed, stored), float("-inf"))
    tied = offered & (offer == tl.max(offer, axis=0))
    first = tl.argmin(tl.where(tied, push_seq, 0x7FFFFFFFFFFFFFFF), axis=0)
    owed = spine_tip >= 0
    parent = tl.where(owed, spine_tip, first)
    at_parent = j == parent
    parent_rank = tl.where(owed, 0, tl.sum(tl.where(at_parent, rank, 0), axis=0))
    at_child = parent.to(tl.int64) * children + parent_rank
    child_logprob = tl.where(
        parent == slot,
        tl.sum(tl.where(c == parent_rank, new_logprobs, 0.0), axis=0),
        tl.load(ChildLogprobs + child_base + at_child, mask=parent != slot, other=0.0),
    )
    token = tl.where(
        parent == slot,
        tl.sum(tl.where(c == parent_rank, new_tokens, 0), axis=0),
        tl.load(ChildTokens + child_base + at_child, mask=parent != slot, other=0),
    )
    score = tl.sum(tl.where(at_parent, scores, 0.0), axis=0) + child_logprob
    depths = tl.load(Depths + base + j, mask=in_row, other=0)
    depth = tl.sum(tl.where(at_parent, depths, 0), axis=0) + 1
    count = tl.load(Count + r)
    pop = (owed | (tl.max(tied.to(tl.int32), axis=0) > 0)) & (count - 1 < budget)
    node = tl.where(pop, count, slots)

    # The popped node filed (the scratch slot when none is), its parent's next child
    # offered, each row written once.
    at_node = j == node
    tokens = tl.load(Tokens + base + j, mask=in_row, other=0)
    parents = tl.load(Parents + base + j, mask=in_row, other=0)
    tl.store(Tokens + base + j, tl.where(at_node, token, tokens), mask=in_row)
    tl.store(Parents + base + j, tl.where(at_node, parent, parents), mask=in_row)
    tl.store(Depths + base + j, tl.where(at_node, depth, depths), mask=in_row)
    tl.store(Scores + base + j, tl.where(at_node, score, scores), mask=in_row)
    sibling = tl.where(pop, parent, slots)
    next_rank = tl.where(j == sibling, parent_rank + 1, next_rank)
    push_seq = tl.where(j == sibling, tl.load(PopSeq), push_seq)
    tl.store(NextRank + base + j, next_rank, mask=in_row)
    tl.store(PushSeq + base + j, push_seq, mask=in_row)
    count += pop.to(count.dtype)
    tl.store(Count + r, count)
    tl.store(Branches + r, branches + (pop & (parent_rank > 0)).to(branches.dtype))
    deeper = depth < max_depth
    tl.store(SpineTip + r, tl.where(owed & pop, tl.where(deeper, node, -1), spine_tip))
    expand = pop & deeper & (count - 1 < budget)
    tl.store(OutNode + r, tl.where(expand, node, state_scratch))
    tl.store(OutParent + r, parent)
    tl.store(OutToken + r, token)
    tl.store(OutDepth + r, tl.where(expand, depth, 0))
    tl.store(OutExpand + r, expand)
