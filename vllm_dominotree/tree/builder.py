"""Best-first draft trees (DDTree's heap) over a pluggable children function.

A tree is grown for every request of a step at once. Each iteration pops, per request,
the candidate with the highest cumulative log-probability, adds it as a node, pushes its
next sibling, and asks the scorer for the new node's children (one batched call for all
requests, which is where the device work and the one host sync per pop happen). Only the
best child of a new node is pushed (lazy expansion), so each pop pushes at most two
candidates and the popped scores never increase.

With `spine`, the greedy path is grown first (so the tree contains the chain and never
accepts less than it, at the price of budget spent on depth); pop order is then
best-first only after the spine.

With `max_leaves`, a tree stops branching once it has that many leaves: a node's first
child replaces it as a leaf, every later child adds one, so past the limit only first
children are popped (the others stay unpopped, as if their scores were -inf). With
`step_leaves`, a step's trees share that many leaves (`TreeShape.for_rows`: the builders
take the shape of the step's padded rows), so a large batch verifies fewer paths.

Scorers (see scorers.py) decide what a node's children are:
  conditional - Domino's correction along the node's own path (DominoTree),
  marginal    - the drafter's per-depth marginals, path-independent (DDTree),
and the chain (the released single-path decoder) is either of them with one child per
node and a budget of one block.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace
from typing import Protocol

ROOT = 0


@dataclass(frozen=True)
class TreeShape:
    budget: int  # drafted nodes per tree (the root, i.e. the anchor token, not counted)
    max_depth: int  # drafts per block K: a node at this depth gets no children
    max_children: int  # children considered per node (the heap's branching limit)
    # Grow the greedy path (every node's best child) to full depth first, then spend the
    # rest of the budget best-first: the tree then always contains the chain.
    spine: bool = False
    # At most this many leaves (root-to-leaf paths) per tree; 0: no limit.
    max_leaves: int = 0
    # At most this many leaves over a step's trees together, shared out evenly over the
    # step's padded rows (`for_rows`); 0: no limit.
    step_leaves: int = 0
    # At most this many nodes over a step's trees together, shared out the same way.
    step_nodes: int = 0

    def __post_init__(self) -> None:
        if min(self.budget, self.max_depth, self.max_children) < 1:
            raise ValueError(f"tree budget, depth and children must be >= 1, got {self}")
        if min(self.max_leaves, self.step_leaves, self.step_nodes) < 0:
            raise ValueError(f"max_leaves, step_leaves and step_nodes must be >= 0, got {self}")

    def for_rows(self, rows: int) -> TreeShape:
        """Each tree's shape in a step of `rows` padded rows (scorers.padded_rows, which
        both builders share): the budget lowered to the rows' share of step_nodes (at
        least one node), then max_leaves to their share of step_leaves (at least one
        leaf: a path). A tree of `budget` nodes has at most `budget` leaves, so a share
        that large changes nothing. A best-first tree of fewer nodes is the larger one's
        first nodes (the pops until then are the same), so a step's trees are prefixes
        of the ones its requests get alone."""
        shape = self
        nodes = max(1, self.step_nodes // rows) if self.step_nodes else self.budget
        if nodes < self.budget:
            shape = replace(shape, budget=nodes)
        share = max(1, self.step_leaves // rows) if self.step_leaves else shape.budget
        if share >= min(shape.max_leaves or shape.budget, shape.budget):
            return shape
        return replace(shape, max_leaves=share)

    @property
    def max_branches(self) -> int:
        """Pops of a child that is not its parent's first (each adds a leaf) a tree may
        take: max_leaves - 1, or the budget when the leaves are not limited."""
        return self.max_leaves - 1 if self.max_leaves else self.budget


@dataclass
class Children:
    """A node's candidate children, best first. logprobs: log-probabilities of each token
    given the node's path (not cumulative)."""

    tokens: list[int]
    logprobs: list[float]


@dataclass(frozen=True)
class Expansion:
    """Ask for the children of `node`, just added to request `request`'s tree."""

    request: int
    node: int
    parent: int  # -1 for the root
    token: int
    depth: int


class Scorer(Protocol):
    """Computes children for a batch of new nodes (one per request at most)."""

    def expand(self, items: list[Expansion]) -> list[Children]: ...


@dataclass
class DraftTree:
    """One request's tree in topological order. Node 0 is the root: the anchor (the last
    verified token), at depth 0. parents[i] < i. Nodes are numbered in pop order, and
    scores are their cumulative log-probabilities (root 0). children[i]: i's child nodes."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    scores: list[float]
    children: list[list[int]] = field(default_factory=list)

    @classmethod
    def root(cls, anchor: int) -> DraftTree:
        return cls([anchor], [-1], [0], [0.0], [[]])

    def add(self, token: int, parent: int, score: float) -> int:
        node = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.scores.append(score)
        self.children.append([])
        self.children[parent].append(node)
        return node

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)


def build_trees(scorer: Scorer, anchors: list[int], shape: TreeShape) -> list[DraftTree]:
    """Grow one best-first tree per request. anchors: the last verified token of each."""
    trees = [DraftTree.root(a) for a in anchors]
    children: list[dict[int, Children]] = [{} for _ in anchors]
    heaps: list[list[tuple[float, int, int, int]]] = [[] for _ in anchors]
    # With a spine, the deepest greedy node whose best child is still owed to the tree.
    spine_tip: list[int | None] = [ROOT if shape.spine else None for _ in anchors]
    branches = [0 for _ in anchors]  # pops of a child past its parent's first
    pushes = 0

    def push(r: int, parent: int, rank: int) -> None:
        nonlocal pushes
        score = trees[r].scores[parent] + children[r][parent].logprobs[rank]
        # Ties pop in push order, so the tree is a pure function of the scores.
        heapq.heappush(heaps[r], (-score, pushes, parent, rank))
        pushes += 1

    def expand(items: list[Expansion]) -> None:
        for item, kids in zip(items, scorer.expand(items), strict=True):
            children[item.request][item.node] = kids
            if kids.tokens and spine_tip[item.request] != item.node:
                push(item.request, item.node, 0)

    expand([Expansion(r, ROOT, -1, a, 0) for r, a in enumerate(anchors)])
    while True:
        popped = False
        new_nodes = []
        for r, tree in enumerate(trees):
            tip = spine_tip[r]
            owed = tip is not None and tip in children[r] and children[r][tip].tokens
            if branches[r] >= shape.max_branches:
                # No more leaves: the offers of later children are dropped (for good: the
                # count only grows), the best first child is next.
                heaps[r] = [e for e in heaps[r] if e[3] == 0]
                heapq.heapify(heaps[r])
            if tree.num_nodes - 1 >= shape.budget or not (heaps[r] or owed):
                continue
            popped = True
            if owed:
                parent, rank = tip, 0
                score = tree.scores[tip] + children[r][tip].logprobs[0]
            else:
                neg_score, _, parent, rank = heapq.heappop(heaps[r])
                score = -neg_score
            kids = children[r][parent]
            branches[r] += rank > 0
            node = tree.add(kids.tokens[rank], parent, score)
            if owed:
                spine_tip[r] = node if tree.depths[node] < shape.max_depth else None
            if rank + 1 < len(kids.tokens):
                push(r, parent, rank + 1)
            # A node's children are only worth computing if one could still be popped.
            if tree.depths[node] < shape.max_depth and tree.num_nodes - 1 < shape.budget:
                new_nodes.append(Expansion(r, node, parent, kids.tokens[rank], tree.depths[node]))
        if not popped:
            return trees
        if new_nodes:
            expand(new_nodes)
