"""Device builder (one captured CUDA graph per build) == host heap, on Qwen3-4B-shaped
random weights in bf16 (H200 only): every scorer, batch 1 and 8."""

from __future__ import annotations

import pytest
import torch

from vllm_dominotree.demo.toy_pair import random_domino_head
from vllm_dominotree.tree import DeviceTreeBuilder, TreeShape, build_trees, make_scorer

HIDDEN, VOCAB, GRU, RANK, K = 2560, 151936, 1024, 256, 16

# Each builder compiles its own steps; the default limit of 8 would run later ones eagerly.
torch._dynamo.config.recompile_limit = 64


@pytest.fixture(scope="module")
def head():
    return random_domino_head(
        hidden=HIDDEN,
        vocab=VOCAB,
        gru_hidden=GRU,
        emb_dim=RANK,
        device="cuda",
        dtype=torch.bfloat16,
    )


@pytest.fixture(scope="module")
def embed():
    gen = torch.Generator(device="cuda").manual_seed(1)
    return torch.randn(VOCAB, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)


def step_inputs(requests: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(requests, K, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    base = (4 * torch.randn(requests, K, VOCAB, generator=gen, device="cuda")).to(torch.bfloat16)
    anchors = torch.randint(0, VOCAB, (requests,), generator=gen, device="cuda")
    return hidden, base, anchors


NO_LIMIT, LEAVES4, STEP32 = {}, {"max_leaves": 4}, {"step_leaves": 32}
# (kind, budget, M, spine, the conditional scorer's Triton step, leaf limits; STEP32 gives
# the 8 requests' step 4 leaves a tree and leaves the single request's tree unlimited)
CASES = [
    ("conditional", 16, 64, False, False, NO_LIMIT),
    ("conditional", 16, 64, False, True, NO_LIMIT),
    ("conditional", 16, 64, False, True, LEAVES4),  # the pop's leaf limit in the Triton pop
    ("conditional", 16, 64, False, True, STEP32),  # each padded size's graph its own limit
    ("conditional", 32, 128, True, False, NO_LIMIT),
    ("conditional", 64, 32, False, True, NO_LIMIT),
    ("marginal", 16, 64, False, False, NO_LIMIT),
    ("marginal", 16, 64, False, False, LEAVES4),
    ("chain", K, VOCAB, False, False, NO_LIMIT),  # the released decoder
    ("chain", K, 64, False, False, NO_LIMIT),  # the chain on the top-M candidates
    ("chain", K, 64, False, True, NO_LIMIT),  # the same on the Triton step (CUDA's default)
]


@pytest.mark.parametrize("requests", [1, 8])
@pytest.mark.parametrize("kind, budget, candidates, spine, kernels, limits", CASES)
def test_device_trees_equal_host_heap(
    head, embed, requests, kind, budget, candidates, spine, kernels, limits
):
    chain = kind == "chain"
    shape = (
        TreeShape(budget=K, max_depth=K, max_children=1)
        if chain
        else TreeShape(budget, max_depth=K, max_children=budget, spine=spine, **limits)
    )
    scorer = make_scorer(
        kind,
        head,
        embed,
        shape=shape,
        candidates=candidates,
        prefix_len=1,
        max_requests=requests,
        kernels=kernels,
    )
    assert scorer.step == ("triton" if kernels else "table" if kind == "marginal" else "torch")
    builder = DeviceTreeBuilder(
        scorer, shape, chain=chain, max_requests=requests, device=torch.device("cuda")
    )
    builder.capture()
    for seed in range(3):
        hidden, base, anchors = step_inputs(requests, seed)
        if kind == "marginal":  # a dominant token per depth, or the tree is one level
            base[:, :, 0] += 40
        scorer.prepare(hidden, base)
        device = builder.build(anchors)
        step_shape = builder.step_shape(requests)
        host = build_trees(scorer, anchors.tolist(), step_shape)
        leaves = step_shape.max_leaves
        for d, h in zip(device, host, strict=True):
            assert (d.tokens, d.parents, d.depths) == (h.tokens, h.parents, h.depths)
            assert d.scores == h.scores  # bit-identical float64, not approximately
            assert h.num_nodes - 1 == shape.budget
            assert max(h.depths) > 1, "a tree of depth 1 would not exercise the states"
            assert not leaves or sum(not c for c in h.children) <= leaves
    assert builder.counts.graph_builds == 3 and builder.counts.eager_builds == 0


def test_the_chains_reduction_compiled_for_cuda_is_max_and_logsumexp():
    """The chain's argmax and normaliser as its compiled step runs them on CUDA (two
    stages over chunks, tree/scorers.best_and_log_normalizer, one dynamic-shape
    compilation) against torch.max and torch.logsumexp over Qwen3's 151,936 logits, with
    tied maxima in two chunks."""
    from vllm_dominotree.tree.scorers import REDUCTION_CHUNK, best_and_log_normalizer

    compiled = torch.compile(best_and_log_normalizer, fullgraph=True, dynamic=True)
    gen = torch.Generator(device="cuda").manual_seed(3)
    for rows in (1, 8):
        logits = 4 * torch.randn(rows, VOCAB, generator=gen, device="cuda")
        logits[0, [5 * REDUCTION_CHUNK + 3, VOCAB - 1]] = 99.0
        best, index, log_z = compiled(logits)
        want = logits.max(dim=-1)
        assert torch.equal(best, want.values) and torch.equal(index, want.indices)
        assert index[0].item() == 5 * REDUCTION_CHUNK + 3
        torch.testing.assert_close(log_z, torch.logsumexp(logits, -1), rtol=0, atol=1e-4)
