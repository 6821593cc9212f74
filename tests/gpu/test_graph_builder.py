"""CUDA-graph builder == eager builder, on Qwen3-4B-shaped random weights (H200 only)."""

from __future__ import annotations

import pytest
import torch

from vllm_dominotree.toy_pair import random_domino_head
from vllm_dominotree.tree import TreeShape, build_trees, make_scorer

HIDDEN, VOCAB, GRU, RANK, K = 2560, 151936, 1024, 256, 16


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
    anchors = torch.randint(0, VOCAB, (requests,), generator=gen, device="cuda").tolist()
    return hidden, base, anchors


@pytest.mark.parametrize("requests", [1, 8])
@pytest.mark.parametrize("budget, candidates", [(16, 64), (32, 128), (64, 32)])
def test_graph_trees_equal_eager_trees(head, embed, requests, budget, candidates):
    shape = TreeShape(budget=budget, max_depth=K, max_children=budget)

    def scorer(graphs: bool):
        return make_scorer("conditional", head, embed, shape=shape, candidates=candidates,
                           prefix_len=1, max_requests=requests, use_cuda_graphs=graphs)  # fmt: skip

    scorers = {graphs: scorer(graphs) for graphs in (False, True)}
    for seed in range(3):
        hidden, base, anchors = step_inputs(requests, seed)
        trees = {}
        for graphs, scorer in scorers.items():
            scorer.prepare(hidden, base)
            trees[graphs] = build_trees(scorer, anchors, shape)
        assert scorers[True]._graphs, "the graph path did not capture anything"
        for eager, graphed in zip(trees[False], trees[True], strict=True):
            assert graphed.tokens == eager.tokens
            assert graphed.parents == eager.parents
            assert graphed.scores == eager.scores  # bit-identical, not approximately
            assert eager.num_nodes - 1 == budget
            assert max(eager.depths) > 1, "a tree of depth 1 would not exercise the states"
