"""Tree rows as rows of causal "path requests", so that the backend's own kernel (FA3)
computes them and they round exactly as a chain's rows do.

A tree row must see the committed prefix, the root, its ancestors and itself. Laid out
in order, that is a causal sequence: the prefix's slots, then the slots of the path's
nodes from depth 1 to the row's depth. A layer's K/V cache viewed with pages of one slot
lets one extra call of the stock kernel take any slot list as a request's keys, so every
root-to-leaf path becomes a request of its own, with no K/V copied. The stock pass over
the real requests is already right for the rows whose ancestors are their causal prefix
(the root and the first chain); each path request's queries are only the rows of its
path that neither that pass nor an earlier path covered, which are always the path's
last rows (a covered row's ancestors are covered), so every fixed row is computed once.
One pass (`every_row`): no stock pass for the target's layers; every row of a step whose
requests are all trees is a path request's query, the root with its tree's first path
(the root is the last key of the prefix), so FA3 runs once per layer, not twice.

`PathTables` holds the device tables one step's path requests are read from (slot table,
key counts, query starts, which forward rows they recompute); they keep their addresses,
so a forward captured in a CUDA graph reads each step's paths at replay, and a step
without paths leaves every request empty (the call then computes nothing). The runner
fills them on the device from the step's description (`PathTables.build`: no host wait,
so asynchronous scheduling stays on); `split_into_paths` / `PathTables.publish` do the same
on the host from host-known trees, the reference that tests and benchmarks check `build`
against and that builds one request per fixed row (FA3's decoding of each row's path).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


def split_into_paths(
    ancestors: np.ndarray, needs_fix: np.ndarray, every_row: bool = False
) -> list[tuple[list[int], int]]:
    """ancestors: [n] a tree's rows' ancestor bits (row i >= 1 owns bit i - 1; the root,
    row 0, has none); needs_fix: [n] bool. Returns one (path, owned) per path request in
    leaf order: the path's row offsets from depth 1 down to its leaf, of which the last
    `owned` rows are the request's queries, the root counted as the path's row before
    depth 1 (owned == len(path) + 1: the root is a query too). Every row that needs a fix
    is owned once; every_row (one pass, no stock pass): every row, the root by the first
    path (a tree of the root alone: ([], 1))."""
    n = len(ancestors)
    bits = [int(a) for a in ancestors]
    below = 0  # bits of rows that are some other row's ancestor
    for i in range(1, n):
        below |= bits[i] & ~(1 << (i - 1))
    covered = [not (every_row or needs_fix[i]) for i in range(n)]
    leaves = [leaf for leaf in range(1, n) if not below >> (leaf - 1) & 1]
    out = []
    for leaf in leaves or ([0] if every_row else []):
        path = [j for j in range(1, n) if bits[leaf] >> (j - 1) & 1]
        rows = [0, *path]
        owned = sum(not covered[j] for j in rows)
        if not owned:
            continue
        if any(not covered[j] for j in rows[: len(rows) - owned]):
            raise AssertionError(f"dominotree: path {path} has a covered row below a fixed one")
        for j in rows:
            covered[j] = True
        out.append((path, owned))
    return out


@dataclass
class PathSpec:
    """One path request of a step (host side)."""

    batch_index: int  # the real request's row in the batch (its block table row)
    root_position: int  # the root's position: the prefix is positions 0 .. root_position
    first_row: int  # the real request's first row (its root) in the forward
    path: list[int]  # row offsets from the root, depth 1 .. leaf
    owned: int  # the last `owned` rows of [root, *path] are this request's queries


def stream_capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class PathTables:
    """Device tables of a step's path requests, allocated once (addresses stay)."""

    def __init__(
        self,
        max_paths: int,
        max_tokens: int,
        max_len: int,
        device: torch.device,
        splits: int | None = None,
    ):
        self.max_len = max_len
        # FA3's key splits for these requests (config.path_splits); None: the stock pass's.
        self.splits = splits
        self.max_paths = max_paths
        self.max_tokens = max_tokens

        def table(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, device=device)

        # Slots of each path request's keys, in order (pages of one slot).
        self.slot_table = table(max_paths, max_len, dtype=torch.int32)
        self.seq_used = table(max_paths, dtype=torch.int32)  # keys per request
        self.query_start = table(max_paths + 1, dtype=torch.int32)
        self.query_rows = table(max_tokens, dtype=torch.long)  # forward rows
        # Per forward row: recomputed by a path request, and its row among the queries.
        self.row_owned = table(max_tokens, dtype=torch.bool)
        self.row_to_query = table(max_tokens, dtype=torch.long)
        # build's scratch: each tree's path requests and queries.
        self._counts = table(2 * max_tokens, dtype=torch.int32)
        # A bound, known on the host, on the queries of the current filling: its trees'
        # rows (build) or its queries (publish).
        self.query_bound = 0
        # FA3's scheduler metadata of the path requests, and what it was computed for: a
        # forward, whether it was captured, and the tables' filling (`clear` counts them).
        self._schedule: torch.Tensor | None = None
        self._schedule_for: tuple[object, bool, int] | None = None
        self._fillings = 0

    def schedule_of(self, forward: object, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """FA3's scheduler metadata for this forward's path requests: computed by the
        forward's first layer (compute()), reused by the others. forward: what every
        layer of one forward shares and no other forward does (its attention metadata,
        built afresh for every step, warm-up and capture; kept here until the next
        forward, so that its identity is not reused). Under a CUDA graph the first
        layer's computation is captured with the rest and replayed every step; a forward
        that is captured never reuses what an eager one computed, nor the reverse, and
        none reuses a schedule of tables filled since."""
        capturing = stream_capturing()
        held = self._schedule_for
        if held is None or held[0] is not forward or held[1:] != (capturing, self._fillings):
            self._schedule = compute()
            self._schedule_for = (forward, capturing, self._fillings)
        return self._schedule

    def clear(self) -> None:
        """No path requests: every request empty, no forward row recomputed. The row
        maps are zeroed too: the attention gathers through them for every forward row
        (cuda_attention.attend_paths), so an earlier, larger step's entries would index
        past a smaller step's rows."""
        self._fillings += 1
        self.query_bound = 0
        self.seq_used.zero_()
        self.query_start.zero_()
        self.row_owned.zero_()
        self.query_rows.zero_()
        self.row_to_query.zero_()

    def publish(
        self,
        specs: list[PathSpec],
        block_table: torch.Tensor,  # [max_reqs, max_blocks] int32 (device)
        block_size: int,
        slot_mapping: torch.Tensor,  # [>= T] the step's slot per forward row (device)
    ) -> None:
        self.clear()
        if not specs:
            return
        device = self.seq_used.device
        if len(specs) > self.seq_used.numel():
            raise RuntimeError(f"dominotree: {len(specs)} path requests over the tables' room")
        roots = np.array([s.root_position for s in specs])
        depths = np.array([len(s.path) for s in specs])
        width = int((roots + 1 + depths).max())
        if width > self.max_len:
            raise RuntimeError(f"dominotree: a path of {width} keys over {self.max_len}")
        owned = np.array([s.owned for s in specs])
        path_rows = np.concatenate([s.first_row + np.asarray(s.path) for s in specs])
        query_rows = np.concatenate(
            [s.first_row + np.asarray([0, *s.path][-s.owned :]) for s in specs]
        )
        # Where each path node's slot goes: request v, key position root + depth.
        node_request = np.repeat(np.arange(len(specs)), depths)
        node_key = np.concatenate(
            [r + 1 + np.arange(d) for r, d in zip(roots, depths, strict=True)]
        )

        def on(values, dtype=torch.long):
            return torch.as_tensor(np.asarray(values), dtype=dtype).to(device, non_blocking=True)

        v = len(specs)
        position = torch.arange(width, device=device)
        requests, root = on([s.batch_index for s in specs]), on(roots)
        pages = block_table[requests][:, position // block_size].long()
        prefix = pages * block_size + position % block_size  # [V, width]
        table = torch.where(position[None, :] <= root[:, None], prefix, 0)
        table[on(node_request), on(node_key)] = slot_mapping[on(path_rows)].long()
        self.slot_table[:v, :width] = table.to(torch.int32)
        self.seq_used[:v] = on(roots + 1 + depths, torch.int32)
        starts = np.concatenate([[0], np.cumsum(owned)])
        self.query_start[: v + 1] = on(starts, torch.int32)
        self.query_start[v + 1 :] = int(starts[-1])
        q = len(query_rows)
        self.query_bound = q
        rows = on(query_rows)
        self.query_rows[:q] = rows
        self.row_owned[rows] = True
        self.row_to_query[rows] = torch.arange(q, device=device)

    @torch.no_grad()
    def build(
        self,
        trees: torch.Tensor,  # [3, K] long: per tree its root row, its rows, its batch row
        rows_per_tree: int,  # W: budget + 1
        num_paths: int,  # a bound on the step's path requests (its drafted rows)
        num_keys: int,  # a bound on any path request's keys (root position + W)
        ancestors: torch.Tensor,  # [>= T] per forward row (tree_step.py)
        needs_fix: torch.Tensor,  # [>= T]
        positions: torch.Tensor,  # [>= T] per forward row (a root row: the root's position)
        block_table: torch.Tensor,  # [max_reqs, max_blocks] int32
        block_size: int,
        slot_mapping: torch.Tensor,  # [>= T] each forward row's slot
        every_row: bool = False,
    ) -> None:
        """The step's path requests from its description on the device, as `publish`
        lays them out, by the Triton kernels of kernels/path_build.py (two launches after
        the clear; CPU: Triton's interpreter, the tests'). The host gives only what it
        knows (the trees' rows, bounds) and waits for nothing. every_row: every row of
        the trees is a query (split_into_paths'), for a step whose requests are all
        trees (the runner's check)."""
        from ..kernels.path_build import build_path_requests

        self.clear()
        if not trees.shape[1] or not num_paths:
            return
        self.query_bound = trees.shape[1] * rows_per_tree
        if num_paths > self.max_paths or num_keys > self.max_len:
            raise RuntimeError(
                f"dominotree: {num_paths} path requests of up to {num_keys} keys over the "
                f"tables' {self.max_paths} x {self.max_len}"
            )
        build_path_requests(
            trees,
            rows_per_tree,
            ancestors,
            needs_fix,
            positions,
            block_table,
            block_size,
            slot_mapping,
            self._counts,
            self.slot_table,
            self.seq_used,
            self.query_start,
            self.query_rows,
            self.row_owned,
            self.row_to_query,
            every_row,
        )


def slot_view(cache: torch.Tensor) -> torch.Tensor:
    """[blocks, page, kv heads, D] -> [blocks * page, 1, kv heads, D]: the same memory as
    pages of one slot, so that a block table of slots addresses any key sequence."""
    blocks, page, heads, dim = cache.shape
    if cache.stride(0) != page * cache.stride(1) or cache.stride(3) != 1:
        raise NotImplementedError(
            f"dominotree: the KV cache's strides {tuple(cache.stride())} do not allow a "
            "one-slot page view (a block's stride must be page x the slot stride); set "
            "DOMINOTREE_CUDA_TREE_ATTENTION=fixup"
        )
    return cache.as_strided(
        (blocks * page, 1, heads, dim), (cache.stride(1), cache.stride(1), cache.stride(2), 1)
    )


def request_path_specs(
    batch_index: int,
    root_position: int,
    first_row: int,
    ancestors: np.ndarray,  # [n] the request's rows' ancestor bits (tree_step.py)
    needs_fix: np.ndarray,  # [n] bool
    each_row: bool = False,
    every_row: bool = False,
) -> list[PathSpec]:
    """One request's path requests. each_row (the rounding reference of the tests and
    benchmarks): one request per fixed row instead, its own path with itself the only
    query, i.e. one-token decoding of that path. every_row: split_into_paths'."""
    if each_row:
        fixed = [i for i in range(len(ancestors)) if needs_fix[i]]
        paths = [([j for j in range(1, i + 1) if ancestors[i] >> (j - 1) & 1], 1) for i in fixed]
    else:
        paths = split_into_paths(ancestors, needs_fix, every_row)
    return [PathSpec(batch_index, root_position, first_row, path, k) for path, k in paths]


def batch_path_specs(
    query_start: torch.Tensor,  # [R + 1] each request's first row
    seq_lens: torch.Tensor,  # [R] keys per request (its rows are the last ones)
    ancestors: torch.Tensor,  # [T] per row (tree_step.py)
    needs_fix: torch.Tensor,  # [T]
    each_row: bool = False,
    every_row: bool = False,
) -> list[PathSpec]:
    """The path requests of a batch described as the attention kernels see it (kernel
    tests and benchmarks; the runner goes from its trees)."""
    specs = []
    for r in range(seq_lens.numel()):
        first, end = int(query_start[r]), int(query_start[r + 1])
        bits, fix = ancestors[first:end].cpu().numpy(), needs_fix[first:end].cpu().numpy() != 0
        root = int(seq_lens[r]) - (end - first)
        specs += request_path_specs(r, root, first, bits, fix, each_row, every_row)
    return specs


def batch_slot_mapping(
    block_table: torch.Tensor, query_start: torch.Tensor, seq_lens: torch.Tensor, page: int
) -> torch.Tensor:
    """[T] the slot of every row (the request's last rows' positions), as vLLM maps them."""
    slots = []
    for r in range(seq_lens.numel()):
        rows = int(query_start[r + 1]) - int(query_start[r])
        pos = torch.arange(int(seq_lens[r]) - rows, int(seq_lens[r]), device=block_table.device)
        slots.append(block_table[r, pos // page].long() * page + pos % page)
    return torch.cat(slots)
