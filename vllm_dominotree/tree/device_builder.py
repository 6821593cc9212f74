"""The best-first builder on the device: every request's tree in fixed-shape tensors.

The same trees as the host heap (builder.py: tokens, parents, scores and pop order, bit
for bit), computed without a host round trip: a tree of budget B takes exactly B pops,
each one argmax over the frontier of every request at once, and the scorer's per-node
step for the popped nodes. On CUDA the whole build (B pops, B - 1 scorer steps, the
root's) is one CUDA graph per padded batch size, captured at engine start; the host
can read the finished trees with one copy (`collect`: tests and benchmarks; the engine
never waits for them). The same function runs eagerly on CPU (the tests' equality with
the heap); CPU engines build with the heap itself, which costs fewer torch calls there,
and `store` files its trees where the graph writes them.

What the next verification step reads is `table` ([fields, requests + 1, slots], the
slots described by tree/ancestry.describe_slots, which numbers the nodes in depth-first
preorder rather than pop order): it stays on the device, so the runner
describes that step without waiting for the trees (engine/tree_step.py). Its last row is
a fixed chain of tokens that never match, for requests scheduled with drafts that no
tree of the last build belongs to.

Per request, node slots 0..B hold the tree in pop order (slot 0 the root) and slot B + 1
is a scratch slot that requests without a pop write. The frontier is per slot: a node
whose children are known offers its best child not yet popped (`next_rank`; C means
none), pushed at `push_seq`. The heap pops the highest cumulative log-probability and,
among equal scores, the earliest push; per request, iteration t pushes the popped node's
next sibling (2t) before the new node's first child (2t + 1), as the heap does, so the
smallest `push_seq` among the tied is the heap's pick. Scores add the children's float64
log-probs in the same order as the heap, hence are the same doubles.

With `spine`, the spine tip's best child is owed before anything is popped (builder.py).
With `max_leaves`, a row that has taken its `max_branches` pops of a later child offers
first children only (`branches` counts them; builder.py); with `step_leaves`, the limit
is the padded rows' share (TreeShape.for_rows), a constant of each padded size's graph.
The chain (one child per node, one block) is the scorer's own unrolled decoder.

A build may begin with the scorer's preparation (`prepare`: the drafter's logits and the
scorer's per-step tables from the caller's fixed buffers), so that on CUDA it is part of
the build's graph rather than a dozen eager launches before it. The caller passes it
where that is possible (one GPU: vLLM's logits need a collective under tensor
parallelism) and up to `prepare_rows` padded requests (the graph pool keeps the largest
size's [rows x depth, vocab] logits for the engine's life).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..cuda_graphs import capture
from .ancestry import NUM_FIELDS, describe_slots
from .builder import DraftTree, TreeShape
from .scorers import ConditionalScorer, MarginalScorer, compiled, padded_rows

UNUSED = -2  # parent of a slot that holds no node (a tree that ran out of candidates)


@dataclass
class BuildCounts:
    """How the builds of an engine ran: replays of a captured graph, or eagerly (on CPU
    the host heap; on CUDA a batch size no graph was captured for, which the runner's
    stats make visible)."""

    graph_builds: int = 0
    eager_builds: int = 0
    prepared_in_build: int = 0  # builds that began with the scorer's preparation


class DeviceTreeBuilder:
    def __init__(
        self,
        scorer: ConditionalScorer | MarginalScorer,
        shape: TreeShape,
        *,
        chain: bool,
        max_requests: int,
        device: torch.device,
        table_width: int | None = None,
        prepare: Callable[[int], None] | None = None,
        prepare_rows: int = 0,
    ):
        """prepare(p): the scorer prepared for p padded requests from the caller's own
        buffers, run first in builds of at most `prepare_rows` padded requests; larger
        builds (and every build without it) expect the scorer prepared before launch."""
        self.scorer, self.shape, self.chain = scorer, shape, chain
        self.prepare, self.prepare_rows = prepare, prepare_rows if prepare else 0
        self.max_requests, self.device = max_requests, device
        r, n, c = max_requests, shape.budget + 2, scorer.max_children
        self.slots = shape.budget + 1  # tree nodes; slot `slots` is the scratch slot
        self.anchors = torch.zeros(r, device=device, dtype=torch.long)
        # The verification step's view of the trees, `table_width` slots per request (at
        # least the tree's; more when vLLM may schedule more drafts than the budget, as
        # on CPU, where it reserves the drafter's block): the tree's slots, then slots
        # without a node. Row r: the no-tree chain, as wide as the table.
        width = max(table_width or self.slots, self.slots)
        self.table = torch.zeros(NUM_FIELDS, r + 1, width, device=device, dtype=torch.long)
        self.no_tree_row = r
        column = torch.arange(width, device=device).expand(r + 1, width).clone()
        tokens, parents = torch.full_like(column, -1), torch.full_like(column, UNUSED)
        parents[r], column[:r] = column[r] - 1, 0
        describe_slots(tokens, parents, column, self.table)
        self.tokens = torch.zeros(r, n, device=device, dtype=torch.long)
        self.parents = torch.zeros(r, n, device=device, dtype=torch.long)
        self.depths = torch.zeros(r, n, device=device, dtype=torch.long)
        self.scores = torch.zeros(r, n, device=device, dtype=torch.float64)
        self.child_logprobs = torch.zeros(r, n, c, device=device, dtype=torch.float64)
        self.child_tokens = torch.zeros(r, n, c, device=device, dtype=torch.long)
        self.next_rank = torch.zeros(r, n, device=device, dtype=torch.long)
        self.push_seq = torch.zeros(r, n, device=device, dtype=torch.long)
        self.count = torch.zeros(r, device=device, dtype=torch.long)  # nodes, root included
        self.spine_tip = torch.zeros(r, device=device, dtype=torch.long)  # -1: none owed
        self.branches = torch.zeros(r, device=device, dtype=torch.long)  # later-child pops
        self.rows = torch.arange(r, device=device)
        self.seqs = torch.arange(-1, 2 * shape.budget, device=device)  # push_seq values
        self.counts = BuildCounts()
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = None
        # On CUDA a build is a few compiled functions inside one graph: a kernel per small
        # torch op costs its launch within the graph too (the H200's batch-1 build ran
        # about 250 kernels in 0.94 ms, 2026-12-03). The empty trees and the finished
        # slots' ancestry are one function each.
        self._start = compiled(self._start_rows, device)
        self._describe = compiled(describe_slots, device)
        self._file_chain = compiled(self._file_chain_rows, device)
        # The pop's bookkeeping is one compiled function; the scorer's step is its own
        # (tree/scorers.py). Not one function for both: Inductor fused the torch step
        # with the pop's argmin into a reduction that Triton 3.x on the H200 failed to
        # compile (TritonGPURemoveLayoutConversions, 2026-12-03), which CPU tests cannot
        # see. With the Triton node step the bookkeeping ends the step's children launch
        # (kernels/tree_pop.py), which also gives the next step its inputs; pop t writes
        # them into buffer t % 2 (a launch never writes what it reads).
        self._kernel_step = scorer.kernel_step if isinstance(scorer, ConditionalScorer) else None
        self._advance = compiled(self._advance_rows, device)
        self._pop_out = [
            (*(torch.zeros(r, device=device, dtype=torch.long) for _ in range(4)),
             torch.zeros(r, device=device, dtype=torch.bool))
            for _ in range(2)
        ]  # fmt: skip

    @torch.no_grad()
    def build(self, anchors: torch.Tensor) -> list[DraftTree]:
        """anchors: [R] the last verified token of each request, on the device; the
        scorer is prepared for these R requests (or `prepare` prepares it). One host wait,
        for the finished trees (tests and benchmarks: the engine launches and leaves the
        trees on the device)."""
        self.launch(anchors)
        return self.collect(anchors.shape[0])

    def step_shape(self, n: int) -> TreeShape:
        """Each tree's shape in a build of n requests (its padded rows' share of
        step_leaves): what the host heap takes to build the trees this builder would."""
        return self.shape.for_rows(padded_rows(n, self.max_requests))

    def prepares(self, n: int) -> bool:
        """Whether a build of n requests prepares the scorer itself."""
        return padded_rows(n, self.max_requests) <= self.prepare_rows

    @torch.no_grad()
    def launch(self, anchors: torch.Tensor) -> None:
        """The build, queued (no wait)."""
        if self.shape.step_nodes and not self.chain:
            raise ValueError(
                "step_nodes: this builder grows every tree to the whole budget; trees of "
                "a step's share of nodes are the host heap's (build_trees, the CPU's)"
            )
        n = anchors.shape[0]
        p = padded_rows(n, self.max_requests)
        self.anchors[:n].copy_(anchors)
        self.counts.prepared_in_build += self.prepares(n)
        graph = self._graphs.get(p)
        if graph is not None:
            graph.replay()
            self.counts.graph_builds += 1
        else:
            self.grow(p)
            self.counts.eager_builds += 1

    def store(self, trees: list[DraftTree]) -> None:
        """File trees built elsewhere (the host heap) where a build writes them."""
        slots = (t.to(self.device) for t in slot_tensors(trees, self.slots))
        describe_slots(*slots, self.table[:, : len(trees), : self.slots])

    def collect(self, n: int) -> list[DraftTree]:
        """The n trees of the last launch, on the host (waits for the build)."""
        s = self.slots
        fields = (self.tokens, self.parents, self.depths, self.scores)
        return _draft_trees(*(f[:n, :s].cpu().numpy() for f in fields))

    @torch.no_grad()
    def capture(self) -> None:
        """Capture the build for every padded batch size (CUDA; at engine start, so that
        no request waits for a capture). The scorer's tables may hold anything here."""
        sizes = sorted({padded_rows(n, self.max_requests) for n in range(1, self.max_requests + 1)})
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compiles and warms every shape
            for p in sizes:
                self.grow(p)
        torch.cuda.current_stream().wait_stream(side)
        for p in reversed(sizes):  # the largest first: later graphs reuse its pool
            graph = torch.cuda.CUDAGraph()
            with capture(graph, pool=self._pool):
                self.grow(p)
            self._pool = graph.pool()
            self._graphs[p] = graph

    def grow(self, p: int) -> None:
        """The whole build for p padded rows, from self.anchors into the slots and the
        table: what `capture` records, and what a caller's own graph may record (the V2
        speculator's draft graph)."""
        anchors, rows = self.anchors[:p], self.rows[:p]
        if self.prepares(p):
            self.prepare(p)
        if self.chain:
            self._grow_chain(p)
            return
        # The root is the first new node; each iteration asks the scorer for the last new
        # node's children, files them in the frontier, and pops the next node.
        node, parent, token, depth, expand = self._start(anchors)
        max_branches = self.shape.for_rows(p).max_branches  # a step's share of step_leaves
        for t in range(self.shape.budget):  # the last pop fills the tree: no children after
            node, parent, token, depth, expand = self._pop(
                t, rows, max_branches, node, parent, token, depth, expand
            )
        self._finish(p)

    def _pop(self, t, rows, max_branches, node, parent, token, depth, expand):
        """Iteration t for [p] rows whose trees may take `max_branches` later-child pops:
        the children of every row's last new node (rows that expand nothing come as the
        scorer's scratch state slot at depth 0), filed, then one pop -> the next node as
        the next step takes it: its state slot, parent, token, depth, whether it
        expands."""
        p = rows.shape[0]
        # The new node's children's push, then the popped node's next sibling's.
        record_seq, pop_seq = self.seqs[2 * t], self.seqs[2 * t + 1]
        if self._kernel_step is None:
            logprobs, tokens = self.scorer.children(rows, node, parent, token, depth)
            filed = (node, expand, logprobs, tokens, record_seq, pop_seq, max_branches)
            return self._advance(self._frontier(p), *filed)
        from ..kernels.domino_step import PopTables

        out = tuple(o[:p] for o in self._pop_out[t % 2])
        shape = self.shape
        pop = PopTables(self._frontier(p), expand, record_seq, pop_seq, out, shape.budget,
                        shape.max_depth, max_branches)  # fmt: skip
        self._kernel_step.gru(rows, node, parent, token, depth)
        self._kernel_step.children(rows, node, depth, pop)
        return out

    def _frontier(self, p: int) -> tuple[torch.Tensor, ...]:
        """The build's tables' first p rows, in the order the pop takes them."""
        tables = (self.tokens, self.parents, self.depths, self.scores, self.child_logprobs)
        tables += (self.child_tokens, self.next_rank, self.push_seq, self.count, self.spine_tip)
        tables += (self.branches,)
        return tuple(t[:p] for t in tables)

    def _start_rows(self, anchors):
        """Empty trees for [p] rows, each with its root (compiled on CUDA: one or two
        kernels in place of a dozen fills) -> the root as the first new node: its slot,
        parent state slot, token, depth, and that it needs children."""
        p = anchors.shape[0]
        self.tokens[:p] = -1
        self.tokens[:p, 0] = anchors
        self.parents[:p] = UNUSED
        self.parents[:p, 0] = -1
        self.depths[:p] = 0
        self.scores[:p] = 0
        self.next_rank[:p] = self.scorer.max_children  # nothing offered
        self.push_seq[:p] = 0
        self.count[:p] = 1
        self.spine_tip[:p] = 0 if self.shape.spine else -1
        self.branches[:p] = 0
        node = torch.zeros_like(anchors)
        parent = torch.full_like(anchors, self.scorer.zero_slot)
        return node, parent, anchors, node, torch.ones_like(anchors, dtype=torch.bool)

    def _grow_chain(self, p: int) -> None:
        """The chain: the scorer's unrolled decoder, one block, filed as a tree."""
        anchors = self.anchors[:p]
        drafts, logprobs = self.scorer.chain(anchors)  # [p, K] each
        self._file_chain(anchors, drafts, logprobs)
        self._finish(p)

    def _file_chain_rows(self, anchors, drafts, logprobs):
        """The chain's K drafts ([p, K] tokens and float64 log-probs) into the slots
        (compiled on CUDA: a few fused kernels where there were about 20, the running
        score alone K float64 adds, 17 us a build on the H100, 2026-12-07; Inductor keeps
        the sums in order)."""
        p, k = drafts.shape
        scores = [torch.zeros_like(logprobs[:, 0])]
        for d in range(k):  # sequential float64 sums, as the heap's
            scores.append(scores[-1] + logprobs[:, d])
        self.tokens[:p] = -1
        self.tokens[:p, : k + 1] = torch.cat([anchors[:, None], drafts], 1)
        self.parents[:p] = UNUSED
        self.parents[:p, : k + 1] = torch.arange(-1, k, device=self.device)
        self.depths[:p] = 0
        self.depths[:p, : k + 1] = torch.arange(k + 1, device=self.device)
        self.scores[:p] = 0
        self.scores[:p, : k + 1] = torch.stack(scores, 1)

    def _finish(self, p: int) -> None:
        """The built slots into the verification table."""
        s = self.slots
        tokens, parents, depths = self.tokens[:p, :s], self.parents[:p, :s], self.depths[:p, :s]
        self._describe(tokens, parents, depths, self.table[:, :p, :s])

    def _advance_rows(
        self,
        frontier,
        new_node,
        new_expanded,
        new_logprobs,
        new_tokens,
        record_seq,
        pop_seq,
        max_branches,
    ):
        """File the children of every row's last new node ([p] slots; rows with
        `new_expanded` False file into the scratch slot), then pop once per row
        ([p, slots + 1] tables, updated in place; at most `max_branches` later-child pops
        a tree) -> the popped node's slot, parent, token, depth, and whether it needs
        children."""
        tokens, parents, depths, scores, child_logprobs, child_tokens = frontier[:6]
        next_rank, push_seq, count, spine_tip, branches = frontier[6:]
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        slot = torch.where(new_expanded, new_node, self.slots)
        child_logprobs[rows, slot] = new_logprobs
        child_tokens[rows, slot] = new_tokens
        spine_next = spine_tip == new_node  # the spine's next node: popped without a push
        next_rank[rows, slot] = torch.where(spine_next, self.scorer.max_children, 0)
        push_seq[rows, slot] = record_seq

        # The pop: the best offer of every row's frontier (ties: the earliest push); past
        # its branches, a row offers first children only.
        shape, c, slots = self.shape, self.scorer.max_children, self.slots
        offered = (next_rank[:, :slots] < c) & (
            (next_rank[:, :slots] == 0) | (branches < max_branches)[:, None]
        )
        rank = next_rank[:, :slots].clamp(max=c - 1)
        offer = scores[:, :slots] + child_logprobs[:, :slots].gather(2, rank[..., None])[..., 0]
        offer = torch.where(offered, offer, float("-inf"))
        tied = offered & (offer == offer.max(1, keepdim=True).values)
        first = torch.where(tied, push_seq[:, :slots], torch.iinfo(torch.long).max).argmin(1)
        owed = spine_tip >= 0
        parent = torch.where(owed, spine_tip, first)
        rank = torch.where(owed, 0, rank[rows, parent])
        score = scores[rows, parent] + child_logprobs[rows, parent, rank]
        pop = (owed | tied.any(1)) & (count - 1 < shape.budget)
        node = torch.where(pop, count, slots)
        token = child_tokens[rows, parent, rank]
        depth = depths[rows, parent] + 1
        tokens[rows, node] = token
        parents[rows, node] = parent
        depths[rows, node] = depth
        scores[rows, node] = score
        # The popped offer gives way to the parent's next child (rank c: none left).
        sibling_slot = torch.where(pop, parent, slots)
        next_rank[rows, sibling_slot] = rank + 1
        push_seq[rows, sibling_slot] = pop_seq
        count += pop
        branches += pop & (rank > 0)
        spine_tip.copy_(
            torch.where(owed & pop, torch.where(depth < shape.max_depth, node, -1), spine_tip)
        )
        expand = pop & (depth < shape.max_depth) & (count - 1 < shape.budget)
        # The next step's inputs: rows that expand nothing compute into the scorer's
        # scratch state slot from depth 0 (here, in the compiled function, not as two
        # more launches per pop).
        step_node = torch.where(expand, node, self.scorer.scratch_slot)
        return step_node, parent, token, torch.where(expand, depth, 0), expand


def slot_tensors(
    trees: list[DraftTree], slots: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host trees in the builder's slot form: tokens, parents, depths, each [n, slots]
    long (slots past a tree's nodes: token -1, parent UNUSED, depth 0)."""
    n = len(trees)
    tokens = torch.full((n, slots), -1, dtype=torch.long)
    parents = torch.full((n, slots), UNUSED, dtype=torch.long)
    depths = torch.zeros((n, slots), dtype=torch.long)
    for i, tree in enumerate(trees):
        k = tree.num_nodes
        tokens[i, :k] = torch.tensor(tree.tokens)
        parents[i, :k] = torch.tensor(tree.parents)
        depths[i, :k] = torch.tensor(tree.depths)
    return tokens, parents, depths


def _draft_trees(
    tokens: np.ndarray, parents: np.ndarray, depths: np.ndarray, scores: np.ndarray
) -> list[DraftTree]:
    """The slots' fields, [n, slots] each (scores float64) -> the trees, each cut at its
    first unused slot."""
    sizes = (parents != UNUSED).sum(1).tolist()
    rows = zip(tokens.tolist(), parents.tolist(), depths.tolist(), scores.tolist(), strict=True)
    trees = []
    for n, (token, parent, depth, score) in zip(sizes, rows, strict=True):
        children = [[] for _ in range(n)]
        for node in range(1, n):
            children[parent[node]].append(node)
        trees.append(DraftTree(token[:n], parent[:n], depth[:n], score[:n], children))
    return trees
