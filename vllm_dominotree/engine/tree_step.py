"""One verification step's trees, as the attention backends and the acceptance read them.

The scheduler gives every request 1 + n verification rows: the root (the last committed
token) and the n drafts the proposer returned last step, in the tree's topological order
(possibly cut short by the scheduler, which keeps a closed subtree, or padded). Rows keep
their own KV slots; only positions and attention follow the tree.

The runner describes the step once, before the target's forward (`TreeStepBuffers.
publish`), in persistent device buffers that the forward only reads. They keep their
addresses for the engine's life, so a forward captured in a CUDA graph reads each step's
trees at replay. Per row r of a tree (offset i from its root):
  ancestors   bit j - 1 set iff the tree's row j (j >= 1) is r or one of its ancestors
              (the root is seen by every row and has no bit; 64 bits cover budget 64)
  needs_fix   1 iff r's ancestor set is not its causal prefix, i.e. the stock causal
              kernel's output for r is wrong (never the root, never a chain's rows)
  delta       tree position - linear position (depth - i, <= 0)
and per logits row (the rows the target's logits come back for, same order):
  request (for every logits row), in_tree, offset, depth, parent_row (its parent's
  logits row, -1 for roots and padding), ancestors, siblings_before (bits of its
  earlier siblings), token (its draft token; -1 for roots and padding, so it never
  matches) and token_row (its row in the forward: for a tree's rows the tree's rows, for
  a prefill's sampled row its last token's). Rows outside trees carry in_tree 0 and
  parent_row -1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from ..tree.ancestry import tree_bits
from ..tree.builder import DraftTree
from .tree_paths import PathTables

PAD_PARENT = -2  # a row the scheduler kept beyond its tree: never accepted, never fixed

# Rows of the staging buffers (one int64 array, one host-to-device copy per step).
_TOKEN_ANCESTORS, _TOKEN_NEEDS_FIX, _TOKEN_DELTA = 0, 1, 2
_REQUEST, _OFFSET, _ANCESTORS, _SIBLINGS, _TOKEN, _TOKEN_ROW, _DEPTH = 3, 4, 5, 6, 7, 8, 9
_PARENT_ROW, _IN_TREE = 10, 11
_FIELDS = 12
# The fields publish writes per tree row, in its order: by forward row, by logits row.
_PER_TOKEN_FIELDS = np.array([_TOKEN_ANCESTORS, _TOKEN_NEEDS_FIX, _TOKEN_DELTA])[:, None]
_PER_LOGIT_FIELDS = np.array(
    [_IN_TREE, _OFFSET, _ANCESTORS, _SIBLINGS, _TOKEN, _PARENT_ROW, _DEPTH]
)[:, None]
_CACHED_VIEWS = 256  # distinct step sizes whose views TreeStepBuffers keeps


@dataclass
class TreeRows:
    """A request's verification rows in this step (host side)."""

    batch_index: int  # the request's row in the batch
    token_row: int  # its first row in the forward's flattened tokens
    logits_row: int  # its first row among the logits
    start: int  # position of the root (num_computed_tokens)
    tokens: list[int]  # per row: the root's anchor, then the drafts
    parents: list[int]  # per row: -1 for the root, PAD_PARENT for padding rows
    depths: list[int]  # per row

    @property
    def num_rows(self) -> int:
        return len(self.parents)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))


def tree_rows(
    batch_index: int,
    token_row: int,
    logits_row: int,
    start: int,
    drafts: list[int],
    tree: DraftTree | None,
) -> TreeRows:
    """Match the scheduled drafts against the tree proposed for them. Placeholder drafts
    (-1, scheduled before any proposal) and a missing tree verify as a chain of those
    tokens, which the target never matches. Real drafts that differ from the tree are a
    bug, and fail loudly rather than verifying a different tree than was drafted."""
    n = len(drafts)
    if tree is None or all(t < 0 for t in drafts):
        return TreeRows(
            batch_index,
            token_row,
            logits_row,
            start,
            [-1, *drafts],
            list(range(-1, n)),
            list(range(n + 1)),
        )
    num_real = min(n + 1, tree.num_nodes)
    if drafts[: num_real - 1] != tree.tokens[1:num_real]:
        raise RuntimeError(
            f"dominotree: scheduled drafts {drafts[:8]}... differ from the proposed tree "
            f"{tree.tokens[1:9]}...; the runner lost track of its trees"
        )
    pad = n + 1 - num_real
    return TreeRows(
        batch_index,
        token_row,
        logits_row,
        start,
        [tree.tokens[0], *drafts],
        tree.parents[:num_real] + [PAD_PARENT] * pad,
        tree.depths[:num_real] + [1] * pad,
    )


@dataclass(frozen=True)
class TreeStep:
    """This step's trees: host rows (CPU attention, counters) and device views of the
    published buffers (CUDA attention, acceptance, commit). Device views are [rows]."""

    trees: list[TreeRows]
    num_tokens: int
    num_logits: int
    logits_ranges: list[tuple[int, int]]  # per request of the batch: [first, end) rows
    token_delta: torch.Tensor
    request: torch.Tensor  # per logits row
    in_tree: torch.Tensor
    offset: torch.Tensor
    ancestors: torch.Tensor
    siblings_before: torch.Tensor
    token: torch.Tensor
    token_row: torch.Tensor
    depth: torch.Tensor
    parent_row: torch.Tensor
    width: int  # rows of the widest tree
    leaves: int  # leaves over all trees (a chain has one)
    any_fix: bool  # some row's output must be recomputed (a branching tree)

    @property
    def branching(self) -> list[TreeRows]:
        return [t for t in self.trees if not t.is_chain]


class TreeStepBuffers:
    """Persistent staging (pinned host) and device buffers for the step description."""

    def __init__(self, capacity: int, device: torch.device):
        pin = device.type == "cuda"
        self.capacity = capacity
        self.host = torch.zeros(_FIELDS, capacity, dtype=torch.int64, pin_memory=pin)
        self.device_rows = torch.zeros(_FIELDS, capacity, dtype=torch.int64, device=device)
        self._host = self.host.numpy()
        self._dirty = 0  # columns written by an earlier step (zeroed before reuse)
        # (tokens, logits rows) -> the buffers' views: a step's sizes repeat, and its ten
        # tensor slices are host time that the GPU waits for in a synchronous step.
        self._views: dict[tuple[int, int], TreeStep] = {}

    def clear(self) -> None:
        """A step without trees: every row causal, nothing to fix (graphs still read)."""
        if self._dirty:
            self._host[:, : self._dirty] = 0
            self.device_rows[:, : self._dirty].copy_(self.host[:, : self._dirty], non_blocking=True)
            self._dirty = 0

    def publish(
        self,
        trees: list[TreeRows],
        num_tokens: int,
        logits_requests: np.ndarray,
        logits_ranges: list[tuple[int, int]],
        logits_token_rows: np.ndarray,
    ) -> TreeStep:
        """logits_requests: [L] the request (batch index) of every logits row;
        logits_ranges: per request, its logits rows [first, end); logits_token_rows: [L]
        each logits row's row in the forward (vLLM's logits indices)."""
        num_logits = len(logits_requests)
        columns = max(num_tokens, num_logits, self._dirty)
        if columns > self.capacity:
            raise RuntimeError(f"dominotree: {columns} rows over the buffers' {self.capacity}")
        h = self._host
        h[:, :columns] = 0
        h[_REQUEST, :num_logits] = logits_requests
        h[_PARENT_ROW, :columns] = -1
        h[_TOKEN_ROW, :num_logits] = logits_token_rows
        width = max((t.num_rows for t in trees), default=1)
        parents = np.full((len(trees), width), PAD_PARENT, dtype=np.int64)
        depths = np.zeros((len(trees), width), dtype=np.int64)
        tokens = np.zeros((len(trees), width), dtype=np.int64)
        for b, t in enumerate(trees):
            parents[b, : t.num_rows] = t.parents
            depths[b, : t.num_rows] = t.depths
            tokens[b, : t.num_rows] = t.tokens
        ancestors, siblings, needs_fix = tree_bits(parents)
        # Every tree row at once: its column among the forward's tokens and the logits.
        offsets = np.arange(width)
        num_rows = np.array([t.num_rows for t in trees], dtype=np.int64)
        valid = offsets[None, :] < num_rows[:, None]  # [B, width]
        first_tokens = np.array([t.token_row for t in trees], dtype=np.int64)[:, None]
        first_logits = np.array([t.logits_row for t in trees], dtype=np.int64)[:, None]
        tok, log = (first_tokens + offsets)[valid], (first_logits + offsets)[valid]
        real_parent = parents >= 0
        h[_PER_TOKEN_FIELDS, tok[None, :]] = np.stack(
            [ancestors[valid], needs_fix[valid], (depths - offsets)[valid]]
        )
        h[_PER_LOGIT_FIELDS, log[None, :]] = np.stack(
            [
                np.ones_like(log),
                np.broadcast_to(offsets, valid.shape)[valid],
                ancestors[valid],
                siblings[valid],
                np.where(real_parent, tokens, -1)[valid],
                np.where(real_parent, first_logits + parents, -1)[valid],
                depths[valid],
            ]
        )
        self.device_rows[:, :columns].copy_(self.host[:, :columns], non_blocking=True)
        self._dirty = max(num_tokens, num_logits)
        has_child = np.zeros_like(parents, dtype=bool)
        b_idx, r_idx = np.nonzero(parents >= 0)
        has_child[b_idx, parents[b_idx, r_idx]] = True
        real = parents != PAD_PARENT
        return replace(
            self.view(num_tokens, num_logits),
            trees=trees,
            logits_ranges=logits_ranges,
            width=width,
            leaves=int((real & ~has_child).sum()),
            any_fix=bool(needs_fix.any()),
        )

    def view(self, num_tokens: int, num_logits: int) -> TreeStep:
        """The device buffers' first rows as a step without host rows: what the last
        publish wrote there (beyond its logits rows: rows of no tree, in_tree 0, which
        acceptance never accepts and which add nothing to any request's bits)."""
        key = (num_tokens, num_logits)
        cached = self._views.get(key)
        if cached is not None:
            return cached
        if len(self._views) >= _CACHED_VIEWS:
            self._views.clear()
        d = self.device_rows
        self._views[key] = TreeStep(
            [],
            num_tokens,
            num_logits,
            [],
            token_delta=d[_TOKEN_DELTA, :num_tokens],
            request=d[_REQUEST, :num_logits],
            in_tree=d[_IN_TREE, :num_logits],
            offset=d[_OFFSET, :num_logits],
            ancestors=d[_ANCESTORS, :num_logits],
            siblings_before=d[_SIBLINGS, :num_logits],
            token=d[_TOKEN, :num_logits],
            token_row=d[_TOKEN_ROW, :num_logits],
            depth=d[_DEPTH, :num_logits],
            parent_row=d[_PARENT_ROW, :num_logits],
            width=1,
            leaves=0,
            any_fix=False,
        )
        return self._views[key]

    def host_bits(self, tree: TreeRows) -> tuple[np.ndarray, np.ndarray]:
        """(ancestors, needs_fix) of a published tree's rows, from the host staging."""
        rows = slice(tree.token_row, tree.token_row + tree.num_rows)
        return self._host[_TOKEN_ANCESTORS, rows], self._host[_TOKEN_NEEDS_FIX, rows] != 0

    @property
    def token_ancestors(self) -> torch.Tensor:
        return self.device_rows[_TOKEN_ANCESTORS]

    @property
    def token_needs_fix(self) -> torch.Tensor:
        return self.device_rows[_TOKEN_NEEDS_FIX]


@dataclass
class TreeVerification:
    """What the attention backends of this worker read: the step buffers, the last
    published step (host rows, for the CPU backend), and which layers are the target's
    (the DFlash drafter's layers run through the same backends and are left alone)."""

    buffers: TreeStepBuffers
    layers: frozenset[str]
    rows_per_tree: int  # budget + 1
    step: TreeStep | None = None
    # CUDA, DOMINOTREE_CUDA_TREE_ATTENTION=paths: the step's path requests (tree_paths.py).
    paths: PathTables | None = None
    # While vLLM warms up and captures its graphs, the fix-up launches even with no
    # trees (its rows then return at once), so that graphs contain it.
    capturing: bool = False


_INSTALLED: TreeVerification | None = None


def install(verification: TreeVerification) -> None:
    """Called once by the runner when the model is loaded (one engine per worker)."""
    global _INSTALLED
    _INSTALLED = verification


def installed() -> TreeVerification | None:
    return _INSTALLED
