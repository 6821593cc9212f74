"""The accept stage of a greedy step as one CUDA graph replay.

A step's acceptance, counters and K/V move (acceptance.accept_step: accept_trees and
step_counters in torch, or one Triton launch with DOMINOTREE_ACCEPT_KERNEL=triton; the
PathKVMover) are about 85 small kernels in torch, each launched by the host (a step launched 189
kernels outside graphs before, 104 with the graph, H200:
benchmarks/results/h200_2026-12-02_accept_graphs).
They read nothing but persistent buffers (the step description, tree_step.py; the
target's tokens and last rows, copied into buffers here; vLLM's slot mapping and query
starts; the KV caches), so one CUDA graph holds all of them.

One graph per padded request count (powers of two, as the builder's graphs) serves every
greedy step of up to that many requests, mixed prefill/decode steps included: a request
has at most 1 + budget logits rows, so the graph for p requests reads p * (1 + budget)
rows, and the rows past the step's own are rows of no tree (TreeStepBuffers.view) that
acceptance never accepts; padded requests accept nothing and move nothing, and their
outputs are cut off. Steps with sampled requests (noise, top-k / top-p per request) run
the same functions eagerly; the runner counts graph and eager accepts, so a graph that
stopped serving shows in the stats.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..cuda_graphs import capture
from ..tree.scorers import padded_rows
from .acceptance import Accepted, accept_step
from .tree_step import TreeStep, TreeStepBuffers

# (step, target tokens [>= L], last logits row per request [R], R, width W) ->
# (the accepted paths, the step's counters [4]); the K/V move happens inside.
AcceptStage = Callable[
    [TreeStep, torch.Tensor, torch.Tensor, int, int], tuple[Accepted, torch.Tensor]
]


def accept_and_move(
    step: TreeStep,
    target: torch.Tensor,  # [>= L] the target's token at every logits row
    last_rows: torch.Tensor,  # [R] each request's last logits row
    num_reqs: int,
    width: int,
    kv_mover: Callable,  # commit.target_kv's: (slots, query starts, paths, counts)
    slot_mapping: torch.Tensor,  # [>= T] the runner's persistent slot per forward row
    query_start: torch.Tensor,  # [>= R + 1] its persistent query starts
    fused: bool = False,  # config.accept_kernel == "triton"
) -> tuple[Accepted, torch.Tensor]:
    """Acceptance, the step's counters and the accepted paths' K/V move: the AcceptStage
    of both runners (each binds its K/V mover and its persistent slot mapping and query
    starts, so that a replay reads each step's), also what their eager path runs."""
    accepted, counters = accept_step(step, target, last_rows, num_reqs, width, fused)
    starts = query_start[: num_reqs + 1]
    kv_mover(slot_mapping, starts, accepted.path_offsets, accepted.num_accepted)
    return accepted, counters


def trimmed(accepted: Accepted, num_reqs: int, num_logits: int, width: int) -> Accepted:
    """A padded stage's result for the step's own requests, rows and width. The sampled
    tokens are copied: vLLM keeps them past the next replay (its host copy is async)."""
    return Accepted(
        accepted.sampled[:num_reqs, :width].clone(),
        accepted.path_offsets[:num_reqs, :width],
        accepted.num_accepted[:num_reqs],
        accepted.accepted[:num_logits],
    )


class AcceptGraphs:
    def __init__(
        self,
        buffers: TreeStepBuffers,
        stage: AcceptStage,
        rows_per_tree: int,  # 1 + budget: the most logits rows of one request
        max_requests: int,
        device: torch.device,
    ):
        self.buffers = buffers
        self.stage = stage
        self.rows_per_tree = rows_per_tree
        self.max_requests = max(1, min(max_requests, buffers.capacity // rows_per_tree))
        self.target = torch.zeros(buffers.capacity, dtype=torch.long, device=device)
        self.last_rows = torch.zeros(self.max_requests, dtype=torch.long, device=device)
        # padded requests -> (graph, its outputs)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[Accepted, torch.Tensor]]] = {}

    def __call__(
        self,
        logits: torch.Tensor,  # [L, V] the step's target logits (greedy requests only)
        last_rows: torch.Tensor,  # [R] each request's last logits row
        width: int,
    ) -> tuple[Accepted, torch.Tensor] | None:
        """The step's acceptance by a graph replay; None when no graph serves it (not
        captured, or a shape beyond the graphs')."""
        num_reqs = last_rows.shape[0]
        if num_reqs > self.max_requests or width > self.rows_per_tree:
            return None
        p = padded_rows(num_reqs, self.max_requests)
        entry = self._graphs.get(p)
        if entry is None:
            return None
        self._load(logits, last_rows, p)
        graph, (accepted, counters) = entry
        graph.replay()
        return trimmed(accepted, num_reqs, logits.shape[0], width), counters

    def run_eager(
        self, logits: torch.Tensor, last_rows: torch.Tensor, width: int
    ) -> tuple[Accepted, torch.Tensor]:
        """What a replay computes, run eagerly (the graphs' reference in the tests)."""
        num_reqs = last_rows.shape[0]
        p = padded_rows(num_reqs, self.max_requests)
        self._load(logits, last_rows, p)
        accepted, counters = self._padded_stage(p)
        return trimmed(accepted, num_reqs, logits.shape[0], width), counters

    def _load(self, logits: torch.Tensor, last_rows: torch.Tensor, p: int) -> None:
        num_reqs = last_rows.shape[0]
        torch.argmax(logits, dim=-1, out=self.target[: logits.shape[0]])
        self.last_rows[:num_reqs].copy_(last_rows)
        self.last_rows[num_reqs:p].zero_()  # any row index will do: nothing is kept

    def _padded_stage(self, p: int) -> tuple[Accepted, torch.Tensor]:
        step = self.buffers.view(0, p * self.rows_per_tree)
        return self.stage(step, self.target, self.last_rows[:p], p, self.rows_per_tree)

    @torch.no_grad()
    def capture(self) -> None:
        """One graph per padded request count, at engine start (CUDA). The step buffers
        must describe no tree then (cleared): the warm-up runs move no K/V."""
        sizes = sorted({padded_rows(n, self.max_requests) for n in range(1, self.max_requests + 1)})
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compiles the K/V move, warms every shape
            for p in sizes:
                self._padded_stage(p)
        torch.cuda.current_stream().wait_stream(side)
        pool = None
        for p in reversed(sizes):  # the largest first: later graphs reuse its pool
            graph = torch.cuda.CUDAGraph()
            with capture(graph, pool=pool):
                outputs = self._padded_stage(p)
            pool = graph.pool()
            self._graphs[p] = (graph, outputs)

    @property
    def captured(self) -> list[int]:
        return sorted(self._graphs)
