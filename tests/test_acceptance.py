"""Sample-and-match acceptance: correct walks, and the target's exact distribution."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare
from tree_helpers import node_path

from vllm_dominotree.tree import DraftTree, SamplingParams, accept, draw_target_tokens, target_probs

VOCAB = 4


def make_tree(spec: list[tuple[int, int]], anchor: int = 0) -> DraftTree:
    """spec: (parent, token) per drafted node, in topological order."""
    tree = DraftTree.root(anchor)
    for parent, token in spec:
        tree.add(token, parent, 0.0)
    return tree


# Nodes (token): root -> 1 (2), 2 (1), 3 (2, a duplicate sibling of node 1);
# node 1 -> node 4 (3); node 3 -> node 5 (0); node 4 -> node 6 (2).
TREE = [(0, 2), (0, 1), (0, 2), (1, 3), (3, 0), (4, 2)]


def test_greedy_walk_takes_the_matching_child_and_returns_the_bonus():
    tree = make_tree(TREE)
    # target tokens per node: root->2 (node 1), node1->3 (node 4), node4->2 (node 6), node6->1
    target = [2, 3, 9, 9, 2, 9, 1]
    assert accept(tree, target) == ([1, 4, 6], 1)
    # Root draws a token no child holds: nothing accepted, the draw is the bonus.
    assert accept(tree, [3, 0, 0, 0, 0, 0, 0]) == ([], 3)
    # A sibling path: root -> 1 (node 2, the second child), which is a leaf.
    assert accept(tree, [1, 0, 0, 0, 0, 0, 0]) == ([2], 0)


def context_logits(path: tuple[int, ...]) -> torch.Tensor:
    """A toy target whose next-token logits depend on the whole path (deterministic)."""
    gen = torch.Generator().manual_seed(hash(path) % (2**31))
    return torch.randn(VOCAB, generator=gen)


def node_paths(tree: DraftTree, prefix: tuple[int, ...]) -> list[tuple[int, ...]]:
    return [
        prefix + tuple(tree.tokens[n] for n in [0, *node_path(tree, i)])
        for i in range(tree.num_nodes)
    ]


def chi2_pvalue(counts: Counter, law: dict, n: int) -> float:
    support = [k for k, p in law.items() if p > 0]
    expected = torch.tensor([law[k] for k in support], dtype=torch.float64)
    expected = (expected / expected.sum() * n).tolist()
    return chisquare([counts[k] for k in support], expected).pvalue


def exact_two_token_law(prefix, params):
    """P(first two tokens after prefix) under the target alone."""
    law = {}
    p1 = target_probs(context_logits(prefix)[None], params)[0]
    for a in range(VOCAB):
        p2 = target_probs(context_logits((*prefix, a))[None], params)[0]
        for b in range(VOCAB):
            law[(a, b)] = float(p1[a] * p2[b])
    return law


def two_tokens_with_tree(tree, prefix, params, gen, biased=False):
    """One speculative round on `tree` (root = last prefix token), completed with plain
    target draws if it emitted fewer than two tokens."""
    paths = node_paths(tree, prefix[:-1])
    logits = torch.stack([context_logits(p) for p in paths])
    drawn = draw_target_tokens(logits, params, gen).tolist()
    if biased:
        # A wrong rule for the negative control: trust the first child whenever the target
        # gives its token at least 20% (a greedy-style shortcut that is not lossless).
        probs = target_probs(logits, params)
        first = tree.children[0][0]
        if probs[0, tree.tokens[first]] > 0.2:
            drawn[0] = tree.tokens[first]
    path, bonus = accept(tree, drawn)
    out = [tree.tokens[n] for n in path] + [bonus]
    while len(out) < 2:
        nxt = draw_target_tokens(context_logits((*prefix, *out))[None], params, gen)
        out.append(int(nxt[0]))
    return tuple(out[:2])


PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.8),
]


@pytest.mark.parametrize("params", PARAMS)
def test_sample_and_match_gives_the_target_distribution(params):
    prefix = (0,)
    tree = make_tree(TREE, anchor=prefix[-1])
    law = exact_two_token_law(prefix, params)
    gen = torch.Generator().manual_seed(1234)
    n = 6000
    counts = Counter(two_tokens_with_tree(tree, prefix, params, gen) for _ in range(n))
    support = {k for k, p in law.items() if p > 0}
    assert set(counts) <= support, "drew a token the target gives zero probability"
    assert chi2_pvalue(counts, law, n) > 1e-3


def test_the_distribution_test_catches_a_biased_acceptance():
    params = PARAMS[0]
    prefix = (0,)
    tree = make_tree(TREE, anchor=prefix[-1])
    law = exact_two_token_law(prefix, params)
    gen = torch.Generator().manual_seed(1234)
    n = 6000
    counts = Counter(two_tokens_with_tree(tree, prefix, params, gen, biased=True) for _ in range(n))
    assert chi2_pvalue(counts, law, n) < 1e-6


def test_target_probs_applies_temperature_top_k_and_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    plain = target_probs(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(plain, torch.softmax(logits / 0.5, -1))
    top2 = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))[0]
    assert top2[2:].sum() == 0 and math.isclose(float(top2.sum()), 1.0, rel_tol=1e-6)
    # top_p 0.7: the first token has ~0.61 of the mass, so the second is kept, not the third.
    p = torch.softmax(logits, -1)[0]
    top_p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))[0]
    assert top_p[0] > 0 and top_p[1] > 0 and top_p[2] == 0 and top_p[3] == 0
    assert math.isclose(float(top_p[0] / top_p[1]), float(p[0] / p[1]), rel_tol=1e-5)


def test_seeded_draws_reproduce():
    logits = torch.randn(5, 50)
    params = SamplingParams(temperature=1.0, seed=42)
    a = draw_target_tokens(logits, params, params.make_generator())
    b = draw_target_tokens(logits, params, params.make_generator())
    c = draw_target_tokens(
        logits, params, SamplingParams(temperature=1.0, seed=43).make_generator()
    )
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_bad_sampling_params_are_refused():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1.0, top_p=0.0)
