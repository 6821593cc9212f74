"""The best-first builder and its scorers, on random Domino heads and drafter outputs."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
import tree_helpers
from tree_helpers import node_path, random_domino_checkpoint

from vllm_dominotree.drafter import Drafter
from vllm_dominotree.tree import DeviceTreeBuilder, TreeShape, build_trees, make_scorer, scorers
from vllm_dominotree.tree.ancestry import TOKEN
from vllm_dominotree.tree.scorers import (
    REDUCTION_CHUNK,
    best_and_log_normalizer,
    padded_rows,
    top_by_rank,
)

V, K = 40, 5


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """A Domino head with random weights (the toy pair's shapes, vocabulary V)."""
    return Drafter.load(random_domino_checkpoint(tmp_path_factory.mktemp("head"), V, K)).head


def random_step(head, requests: int, seed: int):
    return tree_helpers.random_step(head.hidden_size, V, K, requests, seed)


def conditional(head, embed, shape, candidates, requests, prefix_len=1):
    return make_scorer(
        "conditional",
        head,
        embed,
        shape=shape,
        candidates=candidates,
        prefix_len=prefix_len,
        max_requests=requests,
    )


def marginal(embed, shape, requests):
    return make_scorer(
        "marginal", None, embed, shape=shape, candidates=V, prefix_len=1, max_requests=requests
    )


def scorer_of(kind, head, embed, shape, requests):
    """The kind's scorer, conditional with a top-M restriction to 40% of the vocabulary."""
    if kind == "marginal":
        return marginal(embed, shape, requests)
    return conditional(head, embed, shape, candidates=int(V * 0.4), requests=requests)


def device_trees(scorer, shape, anchors, *, chain=False, max_requests=None):
    """The device builder's trees; its table (what the next verification step reads)
    must describe exactly these trees, as `store` describes the heap's."""
    builder = DeviceTreeBuilder(
        scorer,
        shape,
        chain=chain,
        device=torch.device("cpu"),
        max_requests=max_requests or len(anchors),
    )
    trees = builder.build(torch.tensor(anchors))
    n = len(anchors)
    built = builder.table[:, :n].clone()
    no_tree = builder.table[:, builder.no_tree_row].clone()
    builder.store(trees)
    assert torch.equal(built, builder.table[:, :n])
    assert torch.equal(no_tree, builder.table[:, builder.no_tree_row])  # never written
    assert no_tree[TOKEN].tolist() == [-1] * builder.slots  # a chain that never matches
    return trees


def as_tuples(trees):
    return [(t.tokens, t.parents, t.depths, t.scores, t.children) for t in trees]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kind", ["conditional", "marginal"])
def test_tree_properties(head, seed, kind):
    gen = torch.Generator().manual_seed(100 + seed)
    budget = int(torch.randint(1, 30, (1,), generator=gen))
    children = int(torch.randint(1, 6, (1,), generator=gen))
    shape = TreeShape(budget=budget, max_depth=K, max_children=children)
    hidden, base, embed, anchors = random_step(head, 3, seed)
    if kind == "marginal":
        scorer = marginal(embed, shape, requests=3)
    else:
        scorer = conditional(head, embed, shape, candidates=16, requests=3)
    scorer.prepare(hidden, base)
    for tree, anchor in zip(build_trees(scorer, anchors, shape), anchors, strict=True):
        n = tree.num_nodes
        assert tree.tokens[0] == anchor and tree.parents[0] == -1 and tree.depths[0] == 0
        assert 1 <= n - 1 <= budget
        # With a full tree available (children^depth is large) the budget is spent.
        if sum(children**d for d in range(1, K + 1)) >= budget:
            assert n - 1 == budget
        for i in range(1, n):
            p = tree.parents[i]
            assert 0 <= p < i, "topological order / prefix-closed"
            assert tree.depths[i] == tree.depths[p] + 1 <= K
            assert tree.scores[i] <= tree.scores[p]
        assert all(a >= b for a, b in itertools.pairwise(tree.scores[1:])), "pop order"
        for kids in tree.children:
            assert len(kids) <= children
            assert len({tree.tokens[c] for c in kids}) == len(kids), "siblings are distinct"


def brute_force_top_nodes(head, hidden, base, embed, anchor, shape, candidates, prefix_len=1):
    """Score every node of the full tree (all paths, max_children per node, depth <= K)
    straight from Domino's definition and keep the `budget` best: what best-first must
    find. Returns {token path: cumulative log-prob}."""
    state0 = head.initial_state(embed[anchor][None])
    scored = {}
    frontier = [((), state0, 0.0)]
    for depth in range(K):
        top_m = base[depth].topk(min(candidates, V)).indices
        next_frontier = []
        for path, state, score in frontier:
            logits = base[depth][None].clone()
            if depth >= prefix_len:
                logits += head.correction(hidden[depth][None], state)
            logp = torch.log_softmax(logits[0, top_m], -1)
            best = logp.topk(shape.max_children)
            for lp, idx in zip(best.values.tolist(), best.indices.tolist(), strict=True):
                tok = int(top_m[idx])
                child = (*path, tok)
                scored[child] = score + lp
                new_state = head.gru_step(embed[tok][None], state)
                next_frontier.append((child, new_state, score + lp))
        frontier = next_frontier
    best = sorted(scored.items(), key=lambda kv: -kv[1])[: shape.budget]
    return dict(best)


@pytest.mark.parametrize("candidates", [V, 12])
@pytest.mark.parametrize("prefix_len", [0, 1])
def test_conditional_tree_equals_definition(head, candidates, prefix_len):
    """candidates = V: the unrestricted computation; 12: the top-M restriction."""
    shape = TreeShape(budget=12, max_depth=K, max_children=3)
    hidden, base, embed, anchors = random_step(head, 2, seed=3)
    scorer = conditional(head, embed, shape, candidates, requests=2, prefix_len=prefix_len)
    scorer.prepare(hidden, base)
    trees = build_trees(scorer, anchors, shape)
    for r, tree in enumerate(trees):
        expected = brute_force_top_nodes(
            head, hidden[r], base[r], embed, anchors[r], shape, candidates, prefix_len
        )
        got = {
            tuple(tree.tokens[n] for n in node_path(tree, i)): tree.scores[i]
            for i in range(1, tree.num_nodes)
        }
        assert got.keys() == expected.keys()
        for path, score in got.items():
            assert score == pytest.approx(expected[path], abs=1e-4)


@pytest.fixture(scope="module")
def wide_head(tmp_path_factory):
    """A Domino head over more tokens than two reduction chunks hold (the chain's
    argmax in two stages as on CUDA, the last chunk padded)."""
    vocab = 2 * REDUCTION_CHUNK + 37
    return Drafter.load(random_domino_checkpoint(tmp_path_factory.mktemp("wide"), vocab, K)).head


@pytest.mark.parametrize(
    "heads, candidates", [("head", None), ("wide_head", None), ("head", 4), ("wide_head", 8)]
)
def test_chain_equals_domino_decode(heads, candidates, request, monkeypatch):
    """The chain scorer must reproduce Domino's single-path decoder: draft 0 from the
    marginals, then argmax(L_base[i] + embed_proj([h_i ; S])) with the GRU over
    [anchor, drafts...], taken over the marginal top-M candidates of each depth (M =
    candidates, as a tree's children) or, with candidates None (the vocabulary), over
    every token as the released decoder does (the wide head's in CUDA's chunks)."""
    head = request.getfixturevalue(heads)
    if heads == "wide_head":
        chunked = functools.partial(scorers.best_and_log_normalizer, chunked=True)
        monkeypatch.setattr(scorers, "best_and_log_normalizer", chunked)
    shape = TreeShape(budget=K, max_depth=K, max_children=1)
    vocab = head.proj_out.shape[0]
    m = candidates or vocab
    hidden, base, embed, anchors = tree_helpers.random_step(head.hidden_size, vocab, K, 3, 11)
    scorer = make_scorer(
        "chain", head, embed, shape=shape, candidates=m, prefix_len=1, max_requests=3
    )
    scorer.prepare(hidden, base)
    trees = build_trees(scorer, anchors, shape)
    # The engine's unrolled chain (one host copy at the end) builds the very same trees,
    # one per-node step per draft, as the heap does: the same compiled step on CUDA,
    # where a chain compiled as one graph rounded its scores apart (H100, 2026-12-06e).
    steps = []
    node_step = scorer._children
    monkeypatch.setattr(scorer, "_children", lambda *rows: steps.append(1) or node_step(*rows))
    assert as_tuples(device_trees(scorer, shape, anchors, chain=True)) == as_tuples(trees)
    assert len(steps) == K
    outside_top_m = 0  # drafts whose token the whole vocabulary's argmax would not pick
    for r, tree in enumerate(trees):
        drafts = [int(base[r, 0].argmax())]
        state = head.gru_step(embed[drafts[0]][None], head.initial_state(embed[anchors[r]][None]))
        for i in range(1, K):
            logits = base[r, i] + head.correction(hidden[r, i][None], state)[0]
            top_m = base[r, i].topk(m).indices
            drafts.append(int(top_m[logits[top_m].argmax()]))
            outside_top_m += drafts[-1] != int(logits.argmax())
            state = head.gru_step(embed[drafts[-1]][None], state)
        assert tree.parents == list(range(-1, K))
        assert tree.tokens[1:] == drafts
    # The restricted cases must differ from the whole vocabulary somewhere, or they would
    # not tell a restricted chain from an unrestricted one.
    assert (outside_top_m > 0) == (candidates is not None)


def test_marginal_chain_is_the_marginal_argmax(head):
    shape = TreeShape(budget=K, max_depth=K, max_children=1)
    hidden, base, embed, anchors = random_step(head, 3, seed=5)
    scorer = marginal(embed, shape, requests=3)
    scorer.prepare(hidden, base)
    chains = device_trees(scorer, shape, anchors, chain=True)
    assert as_tuples(chains) == as_tuples(build_trees(scorer, anchors, shape))
    assert [t.tokens[1:] for t in chains] == base.argmax(-1).tolist()


def test_marginal_tree_is_path_independent(head):
    shape = TreeShape(budget=20, max_depth=K, max_children=4)
    hidden, base, embed, anchors = random_step(head, 1, seed=5)
    scorer = marginal(embed, shape, requests=1)
    scorer.prepare(hidden, base)
    tree = build_trees(scorer, anchors, shape)[0]
    logp = torch.log_softmax(base[0], -1)
    for i in range(1, tree.num_nodes):
        p = tree.parents[i]
        step = logp[tree.depths[i] - 1, tree.tokens[i]].item()
        assert tree.scores[i] == pytest.approx(tree.scores[p] + step, abs=1e-5)


def test_spine_contains_the_chain(head):
    hidden, base, embed, anchors = random_step(head, 2, seed=9)
    chain_shape = TreeShape(budget=K, max_depth=K, max_children=1)
    chain = make_scorer(
        "chain", head, embed, shape=chain_shape, candidates=V, prefix_len=1, max_requests=2
    )
    chain.prepare(hidden, base)
    chains = build_trees(chain, anchors, chain_shape)
    spine_shape = TreeShape(budget=K + 6, max_depth=K, max_children=3, spine=True)
    tree_scorer = conditional(head, embed, spine_shape, candidates=V, requests=2)
    tree_scorer.prepare(hidden, base)
    for c, t in zip(chains, build_trees(tree_scorer, anchors, spine_shape), strict=True):
        assert t.num_nodes - 1 == K + 6
        # The first K nodes are the greedy path, identical to the chain.
        assert t.tokens[: K + 1] == c.tokens and t.parents[: K + 1] == c.parents


@pytest.mark.parametrize("kind", ["conditional", "marginal"])
def test_max_leaves_limits_the_leaves_and_deepens_them(head, kind):
    """A tree of at most L leaves: no more than L nodes without children, and it stops
    short of its budget only when every leaf is at the block's depth K; one leaf is the
    greedy path (each node's best child, as the chain); without a limit the same steps
    grow more leaves."""
    budget, children = 12, 4
    hidden, base, embed, anchors = random_step(head, 3, 11)
    leaf_counts = {}
    for leaves in (0, 1, 2, 3):
        shape = TreeShape(budget, max_depth=K, max_children=children, max_leaves=leaves)
        scorer = scorer_of(kind, head, embed, shape, requests=3)
        scorer.prepare(hidden, base)
        trees = build_trees(scorer, anchors, shape)
        leaf_counts[leaves] = [sum(not c for c in t.children) for t in trees]
        if leaves:
            assert max(leaf_counts[leaves]) <= leaves, leaf_counts
        for t in trees:
            if t.num_nodes - 1 < budget:  # out of first children: every leaf at depth K
                assert all(d == K for d, c in zip(t.depths, t.children, strict=True) if not c)
        if leaves == 1:
            chain_shape = TreeShape(budget=K, max_depth=K, max_children=1)
            chain_scorer = scorer_of(kind, head, embed, chain_shape, requests=3)
            chain_scorer.prepare(hidden, base)
            for t, c in zip(trees, build_trees(chain_scorer, anchors, chain_shape), strict=True):
                assert (t.tokens, t.parents) == (c.tokens, c.parents)  # K < budget: all of it
    assert max(leaf_counts[0]) > 3, leaf_counts  # the limits above did bind


def test_step_leaves_are_shared_over_the_padded_rows():
    """A step of p padded rows gives each tree step_leaves // p leaves (at least one,
    within max_leaves); a share of the budget or more changes nothing."""
    shape = TreeShape(16, max_depth=K, max_children=16, step_leaves=64)
    leaves = {rows: shape.for_rows(rows).max_leaves for rows in (1, 2, 4, 8, 16, 32, 64, 128)}
    assert leaves == {1: 0, 2: 0, 4: 0, 8: 8, 16: 4, 32: 2, 64: 1, 128: 1}
    assert shape.for_rows(16).max_branches == 3 and shape.for_rows(4).max_branches == 16
    capped = TreeShape(16, max_depth=K, max_children=16, max_leaves=3, step_leaves=64)
    assert capped.for_rows(16) is capped and capped.for_rows(32).max_leaves == 2
    unlimited = TreeShape(16, max_depth=K, max_children=16)
    assert unlimited.for_rows(64) is unlimited


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kind", ["conditional", "marginal"])
def test_step_nodes_give_a_batchs_trees_the_first_nodes_of_their_own(head, seed, kind):
    """A step of p padded rows gives each tree max(1, step_nodes // p) nodes within the
    budget, and a tree of fewer nodes is the first nodes of the whole budget's tree (the
    prefix a verification of fewer rows reads), with step_leaves' share applied to both;
    the device builder refuses such trees (it grows whole budgets)."""
    shape = TreeShape(6, max_depth=K, max_children=6, step_leaves=8, step_nodes=16)
    budgets = {rows: shape.for_rows(rows).budget for rows in (1, 2, 4, 8, 16)}
    assert budgets == {1: 6, 2: 6, 4: 4, 8: 2, 16: 1}
    leaves = {rows: shape.for_rows(rows).max_leaves for rows in (2, 4, 8, 16)}
    assert leaves == {2: 4, 4: 2, 8: 1, 16: 0}  # 16: one node is one leaf anyway
    whole = TreeShape(6, max_depth=K, max_children=6, step_leaves=8)
    hidden, base, embed, anchors = random_step(head, 4, seed)
    scorer = scorer_of(kind, head, embed, whole, requests=4)
    scorer.prepare(hidden, base)
    for rows in (2, 4, 8, 16):
        full = build_trees(scorer, anchors, whole.for_rows(rows))  # the same leaves' share
        smaller = build_trees(scorer, anchors, shape.for_rows(rows))
        for small, big in zip(smaller, full, strict=True):
            n = small.num_nodes
            assert n == min(budgets[rows] + 1, big.num_nodes)  # (one leaf stops at depth K)
            assert (small.tokens, small.parents, small.scores) == (
                big.tokens[:n],
                big.parents[:n],
                big.scores[:n],
            )
    builder = DeviceTreeBuilder(
        scorer, shape, chain=False, device=torch.device("cpu"), max_requests=4
    )
    with pytest.raises(ValueError, match="step_nodes: this builder grows every tree"):
        builder.launch(torch.tensor(anchors))


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("kind", ["conditional", "marginal"])
def test_device_builder_equals_host_heap(head, seed, kind):
    """The device builder (fixed pops, frontier argmax) builds the host heap's trees bit
    for bit: tokens, parents, depths, float64 scores, and pop order (slot numbering).
    Marginal logits rounded to integers make many scores tie, so the heap's push-order
    tie-breaking is exercised; small budgets and widths run frontiers dry; half the seeds
    limit the leaves, per tree or (a quarter) per step, over the padded rows."""
    gen = torch.Generator().manual_seed(200 + seed)
    budget = int(torch.randint(1, 24, (1,), generator=gen))
    children = int(torch.randint(1, 5, (1,), generator=gen))
    spine = bool(seed % 2)
    leaves = int(torch.randint(1, 4, (1,), generator=gen)) if seed % 4 >= 2 else 0
    requests = int(torch.randint(1, 6, (1,), generator=gen))
    step_leaves = 2 * padded_rows(requests, 8) if seed % 4 == 1 else 0  # two a tree
    if step_leaves:  # trees that would branch more than twice
        budget, children = max(budget, 10), 4
    shape = TreeShape(budget, max_depth=K, max_children=children, spine=spine, max_leaves=leaves,
                      step_leaves=step_leaves)  # fmt: skip
    hidden, base, embed, anchors = random_step(head, requests, seed)
    if seed % 3 == 0:
        base = base.round()  # ties
    scorer = scorer_of(kind, head, embed, shape, requests=8)
    scorer.prepare(hidden, base)
    host = build_trees(scorer, anchors, shape.for_rows(padded_rows(requests, 8)))
    device = device_trees(scorer, shape, anchors, max_requests=8)
    assert as_tuples(device) == as_tuples(host)
    assert all(t.num_nodes > 1 for t in host)
    if step_leaves:
        assert max(sum(not c for c in t.children) for t in host) <= 2


@pytest.mark.parametrize("kind", ["conditional", "marginal", "chain"])
def test_a_build_that_prepares_its_scorer_builds_the_trees_of_one_prepared_before(head, kind):
    """On one GPU the build's first stage is the scorer's preparation (inside its graph):
    from the caller's buffer, over the padded rows. Its trees are those of a scorer
    prepared before the build for the step's requests; batches beyond `prepare_rows`
    expect the scorer prepared before the launch, and are counted apart."""
    chain = kind == "chain"
    shape = TreeShape(budget=K if chain else 12, max_depth=K, max_children=1 if chain else 3)
    hidden, _, embed, anchors = random_step(head, 3, seed=21)
    gen = torch.Generator().manual_seed(22)
    scale, bias = torch.randn(V, generator=gen), torch.randn(V, generator=gen)

    def logits(rows):  # a stand-in for the drafter's head, row by row: [p, K, H] -> [p, K, V]
        return 3 * torch.tanh(rows[..., :1] * scale + bias)

    def scorer():
        if kind == "marginal":
            return marginal(embed, shape, requests=8)
        return make_scorer(
            "conditional" if kind == "conditional" else "chain",
            head,
            embed,
            shape=shape,
            candidates=16,
            prefix_len=1,
            max_requests=8,
        )

    before = scorer()
    before.prepare(hidden, logits(hidden))
    want = device_trees(before, shape, anchors, chain=chain, max_requests=8)

    within = scorer()
    buffer = torch.randn(8, K, head.hidden_size, generator=gen)  # stale rows past the step's
    buffer[:3] = hidden

    def prepare(p):
        within.prepare(buffer[:p], logits(buffer[:p]))

    builder = DeviceTreeBuilder(
        within,
        shape,
        chain=chain,
        device=torch.device("cpu"),
        max_requests=8,
        prepare=prepare,
        prepare_rows=4,
    )
    assert builder.prepares(3) and not builder.prepares(5)  # 3 pad to 4, 5 to 8
    assert as_tuples(builder.build(torch.tensor(anchors))) == as_tuples(want)
    assert builder.counts.prepared_in_build == 1

    beyond = anchors + anchors[:2]  # five requests: prepared before the launch
    within.prepare(torch.cat([hidden, hidden[:2]]), logits(torch.cat([hidden, hidden[:2]])))
    assert as_tuples(builder.build(torch.tensor(beyond))[:3]) == as_tuples(want)
    assert builder.counts.prepared_in_build == 1 and builder.counts.eager_builds == 2


def test_device_builder_ties_pop_in_push_order(head):
    """All marginals equal: every candidate of a depth ties, so the tree is decided by
    push order alone (the heap's rule: earlier pushes first)."""
    shape = TreeShape(budget=10, max_depth=K, max_children=3)
    _, _, embed, anchors = random_step(head, 2, seed=1)
    scorer = marginal(embed, shape, requests=2)
    scorer.prepare(None, torch.zeros(2, K, V))
    host = build_trees(scorer, anchors, shape)
    assert as_tuples(device_trees(scorer, shape, anchors)) == as_tuples(host)
    # Depth 2's offers all score 2 log(1/V): node 1's first child was pushed first, then
    # node 2's, node 3's, then node 1's second child (pushed when its first was popped).
    assert host[0].parents[:8] == [-1, 0, 0, 0, 1, 2, 3, 1]


@pytest.mark.parametrize("width", [7, REDUCTION_CHUNK, 3 * REDUCTION_CHUNK + 5])
def test_best_and_log_normalizer_in_chunks_is_max_and_logsumexp(width):
    """The two stages over chunks that CUDA runs (here on CPU tensors)."""
    gen = torch.Generator().manual_seed(width)
    logits = 4 * torch.randn(2, 3, width, generator=gen)
    best, index, log_z = best_and_log_normalizer(logits, chunked=True)
    want = logits.max(dim=-1)
    assert torch.equal(best, want.values) and torch.equal(index, want.indices)
    torch.testing.assert_close(log_z, torch.logsumexp(logits, -1), rtol=0, atol=1e-5)
    # Masked tokens: a whole chunk of -inf (where there are two chunks) changes nothing.
    logits[..., : min(REDUCTION_CHUNK, width - 1)] = float("-inf")
    best, index, log_z = best_and_log_normalizer(logits, chunked=True)
    assert torch.equal(index, logits.max(dim=-1).indices)
    torch.testing.assert_close(log_z, torch.logsumexp(logits, -1), rtol=0, atol=1e-5)
    # Tied maxima in one chunk and across chunks: the first occurrence, as torch.max.
    pairs = [(width - 1, width // 2), (0, width - 1), (width // 2, width // 2 + 1)]
    pairs.append((REDUCTION_CHUNK % width, REDUCTION_CHUNK // 2 % width))
    tied = torch.zeros(len(pairs), width)
    for row, (a, b) in enumerate(pairs):
        tied[row, a] = tied[row, b] = 9.0
    assert best_and_log_normalizer(tied, chunked=True)[1].tolist() == [min(a, b) for a, b in pairs]


def test_top_by_rank_is_topk_with_ties_in_index_order():
    gen = torch.Generator().manual_seed(4)
    values = torch.randn(6, 64, generator=gen)
    got_values, got_index = top_by_rank(values, 16)
    want = values.topk(16, dim=-1)
    assert torch.equal(got_values, want.values) and torch.equal(got_index, want.indices)
    tied = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0]])
    values, index = top_by_rank(tied, 4)
    assert index.tolist() == [[1, 2, 4, 5]] and values.tolist() == [[3.0, 3.0, 3.0, 2.0]]


@pytest.mark.parametrize("kind", ["conditional", "marginal"])
def test_compiled_device_builder_equals_host_heap(head, kind, monkeypatch):
    """On CUDA a build is a few compiled functions (the empty trees, one per pop with the
    conditional scorer's step inlined, the finished slots' ancestry): the same functions
    compiled here by Inductor's CPU backend, as on CUDA (`compiled` runs them eagerly on
    CPU), build the host heap's trees and tables."""
    import vllm_dominotree.tree.device_builder as device_builder
    import vllm_dominotree.tree.scorers as scorers

    def compiled(fn, device):
        return torch.compile(fn, fullgraph=True, dynamic=True)

    monkeypatch.setattr(device_builder, "compiled", compiled)
    monkeypatch.setattr(scorers, "compiled", compiled)
    shape = TreeShape(budget=9, max_depth=K, max_children=3, spine=False)
    hidden, base, embed, anchors = random_step(head, 3, 5)
    scorer = scorer_of(kind, head, embed, shape, requests=4)
    scorer.prepare(hidden, base)
    host = build_trees(scorer, anchors, shape)
    with torch._dynamo.config.patch(recompile_limit=64):  # a builder per test: recompiles
        built = device_trees(scorer, shape, anchors, max_requests=4)
    assert as_tuples(built) == as_tuples(host)


@pytest.mark.parametrize("kind", ["conditional", "chain"])
def test_a_float32_step_over_a_bfloat16_head_builds_the_float32_heads_trees(head, kind):
    """The CPU engine's scorer steps in float32 over a bfloat16 drafter: its trees are
    those of the head converted to float32 beforehand (every table and the embedding rows
    it reads come in float32), on both builders."""
    import copy

    shape = TreeShape(budget=K, max_depth=K, max_children=1)
    if kind == "conditional":
        shape = TreeShape(budget=14, max_depth=K, max_children=3)
    hidden, base, embed, anchors = random_step(head, 3, seed=4)
    bf16_head = copy.deepcopy(head).to(torch.bfloat16)
    f32_head = copy.deepcopy(bf16_head).float()
    hidden, base, embed = hidden.bfloat16(), base.bfloat16(), embed.bfloat16()

    def trees(head, step_dtype):
        scorer = make_scorer(
            kind,
            head,
            embed,
            shape=shape,
            candidates=16,
            prefix_len=1,
            max_requests=3,
            step_dtype=step_dtype,
        )
        assert scorer.states.dtype == torch.float32
        scorer.prepare(hidden, base)
        host = build_trees(scorer, anchors, shape)
        assert as_tuples(device_trees(scorer, shape, anchors, chain=kind == "chain")) == as_tuples(
            host
        )
        return as_tuples(host)

    assert trees(bf16_head, torch.float32) == trees(f32_head, None)
