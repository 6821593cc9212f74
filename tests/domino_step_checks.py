"""Checks of Domino's per-node step in Triton (kernels/domino_step.py), run on the CPU under
Triton's interpreter (test_domino_step.py) and compiled on the H200 (tests/gpu): the
kernels against the torch step, and the builders' trees with the kernels."""

from __future__ import annotations

import torch

from vllm_dominotree.demo.toy_pair import random_domino_head
from vllm_dominotree.tree import DeviceTreeBuilder, TreeShape, build_trees
from vllm_dominotree.tree.scorers import ConditionalScorer, padded_rows


def prepared_scorers(
    head, embed, *, requests, depth, budget, candidates, children, seed, prefix_len=1,
    prepared=None, vocab_ids=None, temperature=1.0,
):  # fmt: skip
    """The torch and the Triton step's scorers for up to `requests` requests, prepared
    for `prepared` of them (default: all) from the same drafter outputs (depths below
    prefix_len uncorrected: the marginals alone); vocab_ids: a draft vocabulary;
    temperature: the scores' (1/T in the tables both steps read)."""
    gen = torch.Generator().manual_seed(seed)
    device, dtype = embed.device, embed.dtype
    n = requests if prepared is None else prepared
    width = embed.shape[0] if vocab_ids is None else vocab_ids.numel()
    hidden = torch.randn(n, depth, head.hidden_size, generator=gen).to(dtype).to(device)
    base = (3 * torch.randn(n, depth, width, generator=gen)).to(dtype).to(device)
    scorers = []
    for kernels in (False, True):
        scorer = ConditionalScorer(
            head,
            embed,
            max_requests=requests,
            num_drafts=depth,
            budget=budget,
            candidates=candidates,
            max_children=children,
            prefix_len=prefix_len,
            kernels=kernels,
            vocab_ids=vocab_ids,
            temperature=temperature,
        )
        scorer.prepare(hidden, base)
        scorers.append(scorer)
    return scorers


def check_step_matches_torch(
    hidden, gru, rank, vocab, candidates, requests, dtype, tolerance, device="cpu",
    temperature=1.0,
):  # fmt: skip
    """Three generations of nodes (the root's children, then a child's, then a
    grandchild's, each row on its own path and depth) through both steps, every
    candidate a child: the same states and log-probs up to the tolerance. In float32 the
    same tokens in the same order (ties, at depth 0, in candidate order); in bfloat16,
    where the torch step rounds its products and gates to bfloat16 and near-ties may
    swap, each token the kernels rank c-th has the torch step's c-th log-prob up to the
    tolerance."""
    device = torch.device(device)
    head = random_domino_head(
        hidden=hidden, vocab=vocab, gru_hidden=gru, emb_dim=rank, device=device, dtype=dtype,
        seed=3,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(4)
    embed = torch.randn(vocab, hidden, generator=gen).to(dtype).to(device)
    torch_step, triton_step = prepared_scorers(
        head, embed, requests=requests, depth=4, budget=6, candidates=candidates,
        children=candidates, seed=5, temperature=temperature,
    )  # fmt: skip
    assert triton_step.step == "triton" and torch_step.step == "torch"
    assert triton_step.temperature == torch_step.temperature == temperature
    for scorer in (torch_step, triton_step):  # depth 0 is uncorrected: ties, in index order
        scorer.base[:, 0] = scorer.base[:, 0].round()
    req = torch.arange(requests, device=device)
    parent = torch.full_like(req, torch_step.zero_slot)
    token = torch.randint(0, vocab, (requests,), generator=gen).to(device)
    for generation in range(3):
        node = torch.full_like(req, generation)
        depth = (req + generation) % 4  # rows at different depths (depth 0: uncorrected)
        want_values, want_tokens = torch_step.children(req, node, parent, token, depth)
        values, tokens = triton_step.children(req, node, parent, token, depth)
        print(f"GRU splits {triton_step._children.splits(requests)}")
        states = triton_step.states[req, node].float()
        state_error = (states - torch_step.states[req, node].float()).abs().max().item()
        value_error = (values - want_values).abs().max().item()
        print(f"generation {generation}: states {state_error:.1e}, log-probs {value_error:.1e}")
        assert state_error < tolerance and value_error < tolerance
        assert values.dtype == torch.float64
        if dtype == torch.float32:
            assert torch.equal(tokens, want_tokens)
        else:  # the torch step's log-prob of each token the kernels picked
            order = want_tokens.argsort(1)
            at = torch.searchsorted(want_tokens.gather(1, order), tokens)
            theirs = want_values.gather(1, order.gather(1, at))
            assert torch.equal(want_tokens.gather(1, order.gather(1, at)), tokens)
            assert (theirs - want_values).abs().max().item() < tolerance
        # the next generation: each row's second child, from the torch step's states
        parent, token = node, tokens[:, 1]
        triton_step.states[req, node] = torch_step.states[req, node]


def check_table_gives_the_products(
    hidden, gru, rank, vocab, candidates, requests, dtype, tolerance, device="cpu"
):
    """A step of at most TABLE_ROWS padded requests: rows below the root whose token is
    one of their depth's candidates take their input products from the table the
    scorer's prepare filled, and get the torch step's states and log-probs up to the
    tolerance; poisoned, the table moves every such row's state and not a root row's
    (depth 0), which is computed from the weights."""
    device = torch.device(device)
    head = random_domino_head(
        hidden=hidden, vocab=vocab, gru_hidden=gru, emb_dim=rank, device=device, dtype=dtype,
        seed=6,
    )  # fmt: skip
    embed = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(7))
    torch_step, triton_step = prepared_scorers(
        head, embed.to(dtype).to(device), requests=requests, depth=4, budget=6,
        candidates=candidates, children=3, seed=8,
    )  # fmt: skip
    assert triton_step.kernel_step.tabled(requests)
    req = torch.arange(requests, device=device)
    parent = torch.full_like(req, torch_step.zero_slot)
    depth = 1 + req % 3
    token = triton_step.cand[req, depth - 1, (5 * req + 1) % candidates]
    node = torch.zeros_like(req)

    def states(depth):
        values, _ = triton_step.children(req, node, parent, token, depth)
        return triton_step.states[req, node].clone(), values

    got, values = states(depth)
    want, _ = torch_step.children(req, node, parent, token, depth)
    state_error = (got.float() - torch_step.states[req, node].float()).abs().max().item()
    value_error = (values - want).abs().max().item()
    print(f"tabled rows: states {state_error:.1e}, log-probs {value_error:.1e}")
    assert state_error < tolerance and value_error < tolerance
    root = torch.zeros_like(depth)  # the root: no candidate row, the weights' products
    root_states = states(root)[0]
    triton_step.kernel_step.gi.fill_(7.0)
    assert (states(depth)[0] != got).any(1).all()  # every tabled row read the table
    assert torch.equal(states(root)[0], root_states)  # no root row did


def check_launch_size_decides_the_table(dtype=torch.float32, tolerance=1e-4, device="cpu"):
    """A builder captures its graph of each padded batch size after whatever prepare came
    last (DeviceTreeBuilder.capture): a launch of more rows than the table holds reads no
    table, however few requests the scorer's last prepare had (on 2026-12-06 a graph of 8
    rows captured after a prepare of one read a table of two rows: other trees than the
    host heap's on the H100)."""
    device = torch.device(device)
    hidden, vocab, candidates = 72, 300, 64
    head = random_domino_head(hidden=hidden, vocab=vocab, gru_hidden=40, emb_dim=24,
                              device=device, dtype=dtype, seed=9)  # fmt: skip
    embed = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(10))
    torch_step, triton_step = prepared_scorers(  # the last prepare: one request, a table
        head, embed.to(dtype).to(device), requests=8, depth=4, budget=6,
        candidates=candidates, children=3, seed=11, prepared=1,
    )  # fmt: skip
    assert triton_step.kernel_step.tabled(triton_step.step_rows)
    triton_step.kernel_step.gi.fill_(7.0)  # read, it would move the states
    req = torch.arange(8, device=device)
    depth = 1 + req % 3
    token = triton_step.cand[req, depth - 1, (5 * req + 1) % candidates]
    node, parent = torch.zeros_like(req), torch.full_like(req, torch_step.zero_slot)
    values, _ = triton_step.children(req, node, parent, token, depth)
    want, _ = torch_step.children(req, node, parent, token, depth)
    states = triton_step.states[req, node].float() - torch_step.states[req, node].float()
    state_error = states.abs().max()
    print(f"8 rows after a prepare of 1: states {state_error.item():.1e}")
    assert state_error.item() < tolerance and (values - want).abs().max().item() < tolerance


def check_trees_equal_heap(seed: int, rows: int = 8) -> None:
    """The device builder and the host heap on the Triton step: the same trees, bit for
    bit (float64 scores, pop order), ties in the marginals included, some with their
    leaves limited, per tree or per step (the heap takes the builder's step shape). rows:
    the scorer's requests (up to TABLE_ROWS: the GRU's input products from the
    candidates' table)."""
    gen = torch.Generator().manual_seed(300 + seed)
    budget = int(torch.randint(1, 20, (1,), generator=gen))
    children = int(torch.randint(1, 5, (1,), generator=gen))
    leaves = (0, 2, 1, 0, 3, 1)[seed % 6]
    requests = int(torch.randint(1, min(rows, 5) + 1, (1,), generator=gen))
    # two leaves a tree, shared over the step's padded rows
    step_leaves = 2 * padded_rows(requests, rows) if seed % 6 == 3 else 0
    if step_leaves:  # trees that would branch more than twice
        budget, children = max(budget, 10), 4
    shape = TreeShape(budget, max_depth=5, max_children=children, spine=bool(seed % 2),
                      max_leaves=leaves, step_leaves=step_leaves)  # fmt: skip
    vocab, hidden = 40, 24
    head = random_domino_head(hidden=hidden, vocab=vocab, gru_hidden=20, emb_dim=8, seed=seed)
    embed = torch.randn(vocab, hidden, generator=gen)
    ties = seed % 3 == 0
    _, scorer = prepared_scorers(
        head, embed, requests=rows, depth=5, budget=budget, candidates=16, children=children,
        seed=seed, prefix_len=5 if ties else 1, prepared=requests,
    )  # fmt: skip
    if ties:  # rounded marginals, uncorrected: equal offers from different nodes
        scorer.base.copy_(scorer.base.round())
    anchors = torch.randint(0, vocab, (requests,), generator=gen).tolist()
    builder = DeviceTreeBuilder(
        scorer, shape, chain=False, max_requests=rows, device=torch.device("cpu")
    )
    host = build_trees(scorer, anchors, builder.step_shape(requests))
    device = builder.build(torch.tensor(anchors))
    fields = [(t.tokens, t.parents, t.depths, t.scores, t.children) for t in host]
    assert fields == [(t.tokens, t.parents, t.depths, t.scores, t.children) for t in device]
    assert all(t.num_nodes > 1 for t in host)


def check_chain_equals_heap(seed: int, rows: int) -> None:
    """Domino's chain on the Triton step (the device builder's unrolled chain) and the
    host heap on a one-child shape: the same chain bit for bit; the torch step's chain
    has its tokens and, within 1e-4, its log-probs. rows: requests (up to TABLE_ROWS: the
    GRU's input products from the candidates' table)."""
    gen = torch.Generator().manual_seed(500 + seed)
    depth, vocab, hidden = 5, 40, 24
    shape = TreeShape(budget=depth, max_depth=depth, max_children=1)
    head = random_domino_head(hidden=hidden, vocab=vocab, gru_hidden=20, emb_dim=8, seed=seed)
    embed = torch.randn(vocab, hidden, generator=gen)
    torch_step, triton_step = prepared_scorers(
        head, embed, requests=rows, depth=depth, budget=depth, candidates=16, children=1,
        seed=seed,
    )  # fmt: skip
    anchors = torch.randint(0, vocab, (rows,), generator=gen).tolist()
    host = build_trees(triton_step, anchors, shape)
    builder = DeviceTreeBuilder(
        triton_step, shape, chain=True, max_requests=rows, device=torch.device("cpu")
    )
    chains = builder.build(torch.tensor(anchors))
    fields = [(t.tokens, t.parents, t.depths, t.scores) for t in host]
    assert fields == [(t.tokens, t.parents, t.depths, t.scores) for t in chains]
    assert all(t.parents == list(range(-1, depth)) for t in chains)
    # Drafted in place by the step's own chain (DominoStep.chain), not the torch step's
    # per-draft columns: its path buffer holds the chains' tokens.
    in_place = triton_step.kernel_step.chain_tokens[:, :rows].T.tolist()
    assert in_place == [t.tokens for t in chains]
    reference = build_trees(torch_step, anchors, shape)
    assert [t.tokens for t in reference] == [t.tokens for t in chains]
    pairs = zip(reference, chains, strict=True)
    error = max(abs(a - b) for r, c in pairs for a, b in zip(r.scores, c.scores, strict=True))
    assert error < 1e-4, error
    print(f"chain of {rows} rows: log-probs {error:.1e}")


def check_draft_vocabulary_trees(seed: int) -> None:
    """With a draft vocabulary (24 of 40 tokens) the Triton step's trees, from the device
    builder and the host heap alike (bit for bit), are the torch step's (scores within
    1e-4) and hold only tokens of the vocabulary: the candidates' table and the GRU's
    embedding rows are read by token id, the marginals by the vocabulary's index."""
    gen = torch.Generator().manual_seed(400 + seed)
    vocab, hidden = 40, 24
    shape = TreeShape(budget=12, max_depth=5, max_children=3)
    head = random_domino_head(hidden=hidden, vocab=vocab, gru_hidden=20, emb_dim=8, seed=seed)
    embed = torch.randn(vocab, hidden, generator=gen)
    vocab_ids = torch.randperm(vocab, generator=gen)[:24].sort().values
    torch_step, triton_step = prepared_scorers(
        head, embed, requests=2, depth=5, budget=12, candidates=16, children=3, seed=seed,
        vocab_ids=vocab_ids,
    )  # fmt: skip
    anchors = torch.randint(0, vocab, (2,), generator=gen).tolist()
    host = build_trees(triton_step, anchors, shape)
    builder = DeviceTreeBuilder(
        triton_step, shape, chain=False, max_requests=2, device=torch.device("cpu")
    )
    device = builder.build(torch.tensor(anchors))
    fields = [(t.tokens, t.parents, t.depths, t.scores, t.children) for t in host]
    assert fields == [(t.tokens, t.parents, t.depths, t.scores, t.children) for t in device]
    for a, b in zip(host, build_trees(torch_step, anchors, shape), strict=True):
        assert (a.tokens, a.parents) == (b.tokens, b.parents)
        assert max(abs(x - y) for x, y in zip(a.scores, b.scores, strict=True)) < 1e-4
    drafted = {token for t in device for token in t.tokens[1:]}
    print(f"draft vocabulary: {len(drafted)} tokens drafted")
    assert drafted <= set(vocab_ids.tolist()) and all(t.num_nodes == 13 for t in device)
