"""The accept graphs' padded computation (engine/accept_graphs.py) equals the plain
acceptance of the step: requests padded to a power of two, logits rows to 1 + budget per
request, with an earlier, larger step's rows left in the buffers. The graphs replay
exactly this computation (tests/gpu/test_accept_graphs.py)."""

from __future__ import annotations

import pytest
import torch
from acceptance_cases import random_step

from vllm_dominotree.engine.accept_graphs import AcceptGraphs
from vllm_dominotree.engine.acceptance import accept_trees, step_counters
from vllm_dominotree.engine.tree_step import TreeStepBuffers

ROWS_PER_TREE = 13  # random_step's trees have at most 12 rows
WIDTH = 12


def stage(step, target, last_rows, num_reqs, width):
    accepted = accept_trees(step, target, last_rows, num_reqs, width)
    return accepted, step_counters(step, accepted)


def greedy_logits(target: torch.Tensor, vocab: int = 5) -> torch.Tensor:
    """[L, vocab] logits whose argmax is target."""
    logits = torch.randn(target.shape[0], vocab, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(target.shape[0]), target] = 10.0
    return logits


@pytest.mark.parametrize("seed", range(12))
def test_padded_acceptance_equals_the_steps_own(seed):
    buffers = TreeStepBuffers(128, torch.device("cpu"))
    random_step(seed + 100, buffers=buffers)  # an earlier step's rows stay behind
    step, _, target, last_rows, _ = random_step(seed, buffers=buffers)
    graphs = AcceptGraphs(buffers, stage, ROWS_PER_TREE, 16, torch.device("cpu"))
    got, counters = graphs.run_eager(greedy_logits(target), last_rows, WIDTH)
    want = accept_trees(step, target, last_rows, 7, WIDTH)
    assert got.sampled.shape == (7, WIDTH) and got.sampled.is_contiguous()
    for name in ("sampled", "path_offsets", "num_accepted", "accepted"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(counters, step_counters(step, want))
    assert int(want.num_accepted.sum()) > 0  # the comparison covers accepted paths


class CountingGraph:
    """Stands in for a captured graph: counts its replays."""

    replays = 0

    def replay(self):
        self.replays += 1


def test_a_graph_serves_its_sizes_and_only_those():
    """The graph of a padded request count serves every step up to it; request counts
    beyond the buffers' room and widths beyond 1 + budget are refused (None: the runner
    then accepts eagerly and counts it)."""
    buffers = TreeStepBuffers(64, torch.device("cpu"))
    graphs = AcceptGraphs(buffers, stage, ROWS_PER_TREE, 16, torch.device("cpu"))
    assert graphs.max_requests == 4  # 64 rows hold four padded requests of 13
    assert graphs(torch.zeros(3, 5), torch.arange(3), WIDTH) is None  # nothing captured
    graph = CountingGraph()
    graphs._graphs[4] = (graph, graphs._padded_stage(4))
    got, _ = graphs(torch.zeros(3, 5), torch.arange(3), WIDTH)
    assert graph.replays == 1 and got.sampled.shape == (3, WIDTH)
    assert graphs(torch.zeros(5, 5), torch.arange(5), WIDTH) is None  # 5 requests > 4
    assert graphs(torch.zeros(3, 5), torch.arange(3), ROWS_PER_TREE + 1) is None
    assert graph.replays == 1 and graphs.captured == [4]
