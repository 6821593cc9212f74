"""One verification step's trees, as the attention backends and the acceptance read them.

The scheduler gives every request 1 + n verification rows: the root (the last committed
token) and the n drafts the proposer returned last step, in the tree's topological order
(possibly cut short by the scheduler, which keeps a closed subtree). Rows keep their own
KV slots; only positions and attention follow the tree.

The runner describes the step once, before the target's forward (`TreeStepBuffers.
publish`), in persistent device buffers that the forward only reads. They keep their
addresses for the engine's life, so a forward captured in a CUDA graph reads each step's
trees at replay. The host knows the step's layout (which rows belong to which request);
what the trees hold comes from the builder's table on the device (tree/device_builder.py,
one row per request of the last build), gathered there: the host never waits for the
trees, which is what lets vLLM's asynchronous scheduling run a step ahead. Per row r of a
tree (offset i from its root):
  ancestors   bit j - 1 set iff the tree's row j (j >= 1) is r or one of its ancestors
              (the root is seen by every row and has no bit; 64 bits cover budget 64)
  needs_fix   1 iff r's ancestor set is not its causal prefix, i.e. the stock causal
              kernel's output for r is wrong (never the root, never a chain's rows)
  delta       tree position - linear position (depth - i, <= 0)
  offset      i (the merged tree attention finds the root's row by it)
and per logits row (the rows the target's logits come back for, same order):
  request (for every logits row), in_tree, offset, depth, parent_row (its parent's
  logits row, -1 for roots and slots without a node), ancestors, siblings_before (bits
  of its earlier siblings), token (its draft token; -1 for roots and slots without a
  node, so it never matches) and token_row (its row in the forward: for a tree's rows
  the tree's rows, for a prefill's sampled row its last token's). Rows outside trees
  carry in_tree 0 and parent_row -1.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ..cuda_graphs import capture
from ..tree.ancestry import ANCESTORS, DEPTH, NEEDS_FIX, PARENT, SIBLINGS, TOKEN
from .tree_paths import PathTables

# Rows of the staging buffers (one int64 array, one host-to-device copy per step).
# Fields the device gathers from the table are adjacent, in the table's order, so that
# they are written as slices: indexing a device tensor with a list of rows copies the
# list from pageable host memory, and that copy waits for the GPU.
_TOKEN_ANCESTORS, _TOKEN_NEEDS_FIX, _TOKEN_DELTA, _TOKEN_OFFSET = 0, 1, 2, 3
_REQUEST, _OFFSET, _TOKEN_ROW, _IN_TREE = 4, 5, 6, 7
_ANCESTORS, _SIBLINGS, _DEPTH = 8, 9, 10  # as ANCESTORS .. DEPTH of the table
_TOKEN, _PARENT_ROW = 11, 12
assert (SIBLINGS, DEPTH) == (ANCESTORS + 1, ANCESTORS + 2), "the slices below need this order"
# Written by the host for the gather only: 1 + each tree row's slot in the flattened
# table (0 for rows of no tree, as every column the host has not written), by forward
# row and by logits row, and each tree logits row's root row among the logits.
_TOKEN_SLOT, _LOGITS_SLOT, _FIRST_LOGITS_ROW = 13, 14, 15
# Per tree (column k: the step's k-th tree): its root's row in the forward, its rows,
# its batch row (the path requests' build reads them on the device, tree_paths.py).
_TREE_ROW, _TREE_ROWS, _TREE_REQUEST = 16, 17, 18
_FIELDS = 19
_CACHED_VIEWS = 256  # distinct step sizes whose views TreeStepBuffers keeps


@dataclass
class TreeRows:
    """A request's verification rows in this step, as the host knows them (what the
    tree holds stays on the device, in the builder's table)."""

    batch_index: int  # the request's row in the batch
    token_row: int  # its first row in the forward's flattened tokens
    logits_row: int  # its first row among the logits
    # The root's position (num_computed_tokens). Exact under synchronous scheduling (the
    # CPU); under asynchronous scheduling the host's count assumes every draft was
    # accepted, and only the device positions (vLLM's, corrected on the GPU) are right:
    # on CUDA it is only a bound (the path requests' keys, runner._publish_paths).
    start: int
    num_rows: int  # 1 + the drafts scheduled
    table_row: int  # the tree's row in the builder's table (its no-tree row: no tree)


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
    # Some row's output may need recomputing: a tree of more than two rows (whether it
    # branches is known on the device only).
    any_fix: bool


class TreeStepBuffers:
    """Persistent staging (pinned host) and device buffers for the step description."""

    def __init__(self, capacity: int, device: torch.device):
        pin = device.type == "cuda"
        self.capacity = capacity
        self.host = torch.zeros(_FIELDS, capacity, dtype=torch.int64, pin_memory=pin)
        self.device_rows = torch.zeros(_FIELDS, capacity, dtype=torch.int64, device=device)
        self._host = self.host.numpy()
        self._dirty = 0  # columns written by an earlier step (zeroed before reuse)
        # CUDA: the gather over every column as one captured graph, for the table it was
        # captured with (capture); its replays and the eager gathers are counted.
        self._gather_graph: tuple[torch.cuda.CUDAGraph, int] | None = None
        self.graph_gathers = 0
        self.eager_gathers = 0
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
        table: torch.Tensor,
    ) -> TreeStep:
        """logits_requests: [L] the request (batch index) of every logits row;
        logits_ranges: per request, its logits rows [first, end); logits_token_rows: [L]
        each logits row's row in the forward (vLLM's logits indices); table: the
        builder's described slots, [fields, rows, slots] on the device."""
        num_logits = len(logits_requests)
        columns = max(num_tokens, num_logits, self._dirty)
        if columns > self.capacity:
            raise RuntimeError(f"dominotree: {columns} rows over the buffers' {self.capacity}")
        h = self._host
        h[:, :columns] = 0
        h[_REQUEST, :num_logits] = logits_requests
        h[_TOKEN_ROW, :num_logits] = logits_token_rows
        h[[_PARENT_ROW, _TOKEN], :columns] = -1  # the gather's defaults
        # Every tree row at once: its column among the forward's tokens and the logits,
        # and its slot in the table.
        slots = table.shape[2]
        num_rows = np.array([t.num_rows for t in trees], dtype=np.int64)
        if num_rows.max(initial=0) > slots:
            raise RuntimeError(
                f"dominotree: a request was scheduled {num_rows.max() - 1} drafts, more than "
                f"the {slots - 1} the tree table holds; the runner lost track of its trees"
            )
        offsets = np.arange(num_rows.max(initial=1))
        valid = offsets[None, :] < num_rows[:, None]  # [B, width]
        first_tokens = np.array([t.token_row for t in trees], dtype=np.int64)[:, None]
        first_logits = np.array([t.logits_row for t in trees], dtype=np.int64)[:, None]
        table_rows = np.array([t.table_row for t in trees], dtype=np.int64)[:, None]
        tok, log = (first_tokens + offsets)[valid], (first_logits + offsets)[valid]
        slot = (table_rows * slots + offsets)[valid] + 1
        h[_TOKEN_SLOT, tok] = slot
        h[_LOGITS_SLOT, log] = slot
        h[_FIRST_LOGITS_ROW, log] = np.broadcast_to(first_logits, valid.shape)[valid]
        h[_IN_TREE, log] = 1
        h[_OFFSET, log] = np.broadcast_to(offsets, valid.shape)[valid]
        h[_TREE_ROW, : len(trees)] = first_tokens[:, 0]
        h[_TREE_ROWS, : len(trees)] = num_rows
        h[_TREE_REQUEST, : len(trees)] = [t.batch_index for t in trees]
        self.device_rows[:, :columns].copy_(self.host[:, :columns], non_blocking=True)
        self._dirty = max(num_tokens, num_logits)
        if trees:
            if self._gather_graph is not None and self._gather_graph[1] == table.data_ptr():
                self._gather_graph[0].replay()
                self.graph_gathers += 1
            else:
                self._gather(table, num_tokens, num_logits)
                self.eager_gathers += 1
        return replace(
            self.view(num_tokens, num_logits),
            trees=trees,
            logits_ranges=logits_ranges,
            width=int(num_rows.max(initial=1)),
            any_fix=bool((num_rows > 2).any()),
        )

    @torch.no_grad()
    def capture(self, table: torch.Tensor) -> None:
        """The gather of every column from `table` (the builder's, or V2's tables by
        request slot) as one CUDA graph, at engine start: a step then describes its trees
        with one replay instead of ~20 launches. Columns past the step's read slot 0 (no
        tree) and get its defaults. The gathers are counted from here (warm-up steps
        before it gathered eagerly)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._gather(table, self.capacity, self.capacity)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with capture(graph):
            self._gather(table, self.capacity, self.capacity)
        self._gather_graph = (graph, table.data_ptr())
        self.graph_gathers = self.eager_gathers = 0

    def _gather(self, table: torch.Tensor, num_tokens: int, num_logits: int) -> None:
        """The tree fields of the first rows, from the table on the device."""
        d, flat = self.device_rows, table.view(table.shape[0], -1)
        slot = d[_TOKEN_SLOT, :num_tokens]
        inside = slot > 0
        at = (slot - 1).clamp(min=0)
        v = flat[:, at]  # [fields, T]
        offset = at % table.shape[2]
        d[_TOKEN_ANCESTORS : _TOKEN_OFFSET + 1, :num_tokens] = torch.where(
            inside, torch.stack([v[ANCESTORS], v[NEEDS_FIX], v[DEPTH] - offset, offset]), 0
        )
        slot = d[_LOGITS_SLOT, :num_logits]
        inside = slot > 0
        v = flat[:, (slot - 1).clamp(min=0)]  # [fields, L]
        node = inside & (v[PARENT] >= 0)  # a drafted node (not the root, not an empty slot)
        d[_ANCESTORS : _DEPTH + 1, :num_logits] = torch.where(inside, v[ANCESTORS : DEPTH + 1], 0)
        d[_TOKEN : _PARENT_ROW + 1, :num_logits] = torch.where(
            node, torch.stack([v[TOKEN], d[_FIRST_LOGITS_ROW, :num_logits] + v[PARENT]]), -1
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
            any_fix=False,
        )
        return self._views[key]

    def tree_rows(self, num_trees: int) -> torch.Tensor:
        """[3, num_trees] long on the device: the published trees' root rows in the
        forward, their rows and their batch rows."""
        return self.device_rows[_TREE_ROW : _TREE_REQUEST + 1, :num_trees]

    @property
    def token_ancestors(self) -> torch.Tensor:
        return self.device_rows[_TOKEN_ANCESTORS]

    @property
    def token_needs_fix(self) -> torch.Tensor:
        return self.device_rows[_TOKEN_NEEDS_FIX]

    @property
    def token_offset(self) -> torch.Tensor:
        return self.device_rows[_TOKEN_OFFSET]

    def may_fix_rows(self, step: TreeStep | None) -> bool:
        """Whether some row of the published step may need fixing: on CPU read here (the
        buffers are host memory); on CUDA that is on the device, and taken as yes (a read
        would wait for the GPU)."""
        if step is None:
            return False
        if self.device_rows.device.type != "cpu":
            return True
        return bool(self.device_rows[_TOKEN_NEEDS_FIX, : step.num_tokens].any())


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
    # One pass ("one-pass", "one-pass-fixup"; on CPU always): a step whose requests are
    # all trees skips the stock pass in the target's layers, every row recomputed (by
    # the path requests or the fix-up's kernel, whose `needs_fix` is then `all_rows`).
    # every_row: this forward is such a step (set by the runner for its forward, cleared
    # after it).
    one_pass: bool = False
    every_row: bool = False
    all_rows: torch.Tensor | None = None
    # "one-pass-merge" (set: `merge`): such a step runs FA3 over each request's prefix
    # and the tree rows' own kernel (kernels/tree_merge.py), not the path requests
    # (other steps still do). The step's committed keys per batch row (its root's
    # position), FA3's key counts for the prefixes, written before the forward
    # (publish_prefixes); rows past the step's requests 0 (padding requests see no key).
    prefix_lens: torch.Tensor | None = None  # [max_num_tokens] int32
    # While vLLM warms up and captures its graphs, the fix-up launches even with no
    # trees (its rows then return at once), so that graphs contain it.
    capturing: bool = False
    # Capture's own record (no step writes it): the token counts of the FULL graphs
    # captured without the stock pass (one pass), which the runners report, so that a
    # one pass whose graphs kept the stock pass cannot pass unseen.
    one_pass_graphs: set[int] = field(default_factory=set)
    # DOMINOTREE_CHECK_TREE_ATTENTION=1 (engine/attention_check.py): recomputed rows
    # checked against the dense reference in eager forwards.
    check: bool = False

    @property
    def merge(self) -> bool:
        return self.prefix_lens is not None

    def publish_prefixes(self, num_trees: int, positions: torch.Tensor) -> None:
        """prefix_lens for a one-pass step of the merged mode, on the device: each tree's
        root position (positions: [>= T] per forward row, the device's, exact under
        asynchronous scheduling) at its batch row."""
        root_rows, _, batch_rows = self.buffers.tree_rows(num_trees)
        self.prefix_lens.zero_()
        self.prefix_lens.index_copy_(0, batch_rows, positions[root_rows].to(torch.int32))

    def begin_step(
        self, num_trees: int, all_trees: bool, positions: torch.Tensor, fixes_rows: bool = True
    ) -> StepChoice:
        """A step's tree attention, chosen by the runner before its forward: one pass
        where its requests are all trees and some row needs fixing (`every_row`, the
        merged mode's prefixes published), and whether the step's path requests are
        built: they verify it unless it is a one-pass step of the merged mode.
        fixes_rows: TreeStepBuffers.may_fix_rows (on CPU, without a row to fix, vLLM's
        pass alone is right and cheaper than path requests)."""
        every_row = self.one_pass and all_trees and fixes_rows
        self.every_row = every_row
        if every_row and self.merge:
            self.publish_prefixes(num_trees, positions)
        builds_paths = self.paths is not None and not (every_row and self.merge)
        return StepChoice(every_row, builds_paths)


@dataclass(frozen=True)
class StepChoice:
    """TreeVerification.begin_step's choice for one step."""

    every_row: bool  # one pass: no stock pass in the target's layers
    builds_paths: bool  # the runner builds the step's path requests


_INSTALLED: TreeVerification | None = None


def install(verification: TreeVerification) -> None:
    """Called once by the runner when the model is loaded (one engine per worker)."""
    global _INSTALLED
    _INSTALLED = verification


def installed() -> TreeVerification | None:
    return _INSTALLED
