"""A capture through vllm_dominotree.cuda_graphs.capture runs no garbage collection,
where a bare torch.cuda.graph does under the same allocations (so the check can fail),
and its graph replays right (CUDA)."""

from __future__ import annotations

import gc

import torch

from vllm_dominotree.cuda_graphs import capture


def collections_during(capturing) -> tuple[int, torch.Tensor]:
    """Collections started while `capturing(graph)` captures x * 2 + 1 and allocates
    reference cycles (garbage after each step, with the collector's threshold at 1), and
    the graph's output after a replay on new input."""
    x = torch.zeros(8, device="cuda")
    started = []

    def record(phase, info):
        if phase == "start":
            started.append(info["generation"])

    threshold, enabled = gc.get_threshold(), gc.isenabled()
    # On, whatever the process did: on the H100 (2026-12-07e) the bare capture below saw
    # no collection at all, and whether the collector was off there was not checked.
    gc.enable()
    gc.set_threshold(1, 1, 1)
    gc.callbacks.append(record)
    try:
        graph = torch.cuda.CUDAGraph()
        with capturing(graph):
            before = len(started)  # torch.cuda.graph collects once on entry
            y = x * 2 + 1
            for _ in range(50):
                cycle = []
                cycle.append(cycle)
            during = len(started) - before
    finally:
        gc.callbacks.remove(record)
        gc.set_threshold(*threshold)
        if not enabled:
            gc.disable()
    x.copy_(torch.arange(8.0, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    return during, y


def test_no_collection_inside_the_plugins_capture():
    during, y = collections_during(capture)
    assert during == 0
    assert torch.equal(y, torch.arange(8.0, device="cuda") * 2 + 1)


def test_a_bare_capture_collects_under_the_same_allocations():
    during, _ = collections_during(lambda graph: torch.cuda.graph(graph))
    assert during > 0
