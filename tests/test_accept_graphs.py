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


def test_shapes_beyond_the_graphs_are_refused():
    buffers = TreeStepBuffers(64, torch.device("cpu"))
    graphs = AcceptGraphs(buffers, stage, ROWS_PER_TREE, 16, torch.device("cpu"))
    assert graphs.max_requests == 4  # 64 rows hold four padded requests of 13
    logits = torch.zeros(3, 5)
    # Nothing captured on CPU: no replay; a request count or width beyond the graphs'
    # is refused before any graph is looked up.
    assert graphs(logits, torch.arange(3), WIDTH) is None
    assert graphs(logits, torch.arange(5), WIDTH) is None
    assert graphs.captured == []
