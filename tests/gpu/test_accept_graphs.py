"""The accept stage replayed as a CUDA graph (engine/accept_graphs.py), with the fused
acceptance kernel, == the torch reference's eager acceptance of each step, K/V moves
included: random trees beside one-row requests, the
graphs captured once over cleared buffers and replayed for step after step."""

from __future__ import annotations

import torch
from acceptance_cases import random_step

from vllm_dominotree.engine.accept_graphs import AcceptGraphs
from vllm_dominotree.engine.acceptance import accept_step, accept_trees, step_counters
from vllm_dominotree.engine.tree_step import TreeStepBuffers
from vllm_dominotree.kernels.kv_move import PathKVMover

ROWS_PER_TREE, WIDTH, CAPACITY = 13, 12, 128
BLOCKS, KV_HEADS, PAGE, ROW = 24, 2, 16, 2 * 64  # the cache: [blocks, heads, page, 2 * dim]


def test_graph_replays_equal_eager_acceptance():
    device = torch.device("cuda")
    buffers = TreeStepBuffers(CAPACITY, device)
    gen = torch.Generator(device="cuda").manual_seed(0)
    start = torch.randn(BLOCKS, KV_HEADS, PAGE, ROW, generator=gen, device=device)
    caches = {name: [start.to(torch.bfloat16).clone() for _ in range(2)] for name in "ge"}
    movers = {name: PathKVMover(c) for name, c in caches.items()}
    slot_mapping = torch.zeros(CAPACITY, dtype=torch.int32, device=device)
    query_start = torch.zeros(17, dtype=torch.int32, device=device)

    def stage(step, target, last_rows, num_reqs, width):
        # CUDA's: the fused kernel (kernels/tree_accept.py); the eager side below keeps
        # the torch reference.
        accepted, counters = accept_step(step, target, last_rows, num_reqs, width, fused=True)
        movers["g"](
            slot_mapping, query_start[: num_reqs + 1], accepted.path_offsets, accepted.num_accepted
        )
        return accepted, counters

    graphs = AcceptGraphs(buffers, stage, ROWS_PER_TREE, 16, device)
    graphs.capture()
    assert graphs.captured == [1, 2, 4, 8, 9]  # 128 rows hold nine requests of 13
    assert all(torch.equal(c, caches["e"][0]) for c in caches["g"])  # warm-ups moved nothing
    moves = 0
    for seed in range(10):
        step, _, target, last_rows, starts = random_step(seed, buffers=buffers)
        slots = torch.randperm(BLOCKS * PAGE, generator=torch.Generator().manual_seed(seed))
        slot_mapping.copy_(slots[:CAPACITY].to(torch.int32))
        query_start[: starts.shape[0]].copy_(starts)
        logits = torch.randn(target.shape[0], 5, device=device)
        logits[torch.arange(target.shape[0]), target.to(device)] = 10.0
        got, counters = graphs(logits, last_rows.to(device), WIDTH)
        want = accept_trees(step, target.to(device), last_rows.to(device), 7, WIDTH)
        movers["e"](slot_mapping, query_start[:8], want.path_offsets, want.num_accepted)
        for name in ("sampled", "path_offsets", "num_accepted", "accepted"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (seed, name)
        assert torch.equal(counters, step_counters(step, want))
        assert all(torch.equal(g, e) for g, e in zip(caches["g"], caches["e"], strict=True))
        moves += int(counters[2])
    assert moves > 0  # some paths were not rows 1..k: their K/V moved
    assert not torch.equal(caches["g"][0], start.to(torch.bfloat16))


def test_describing_and_accepting_a_step_wait_for_nothing(monkeypatch):
    """Under asynchronous scheduling the host prepares the next step while the GPU runs
    this one; one wait in the step's description or acceptance (a `.item()`, a copy from
    pageable memory such as a list used as a device index) would serialize them. CUDA's
    sync check raises on any."""
    device = torch.device("cuda")
    buffers = TreeStepBuffers(CAPACITY, device)
    random_step(0, buffers=buffers)  # first calls (allocations, kernel loads) unchecked
    publish = TreeStepBuffers.publish

    def strict_publish(self, *args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return publish(self, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(TreeStepBuffers, "publish", strict_publish)
    for seed in range(1, 4):
        step, _, target, last_rows, _ = random_step(seed, buffers=buffers)
        target, last_rows = target.to(device), last_rows.to(device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            accepted = accept_trees(step, target, last_rows, 7, WIDTH)
            step_counters(step, accepted)
        finally:
            torch.cuda.set_sync_debug_mode("default")
