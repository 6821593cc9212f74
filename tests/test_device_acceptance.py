"""The engine's batched acceptance (engine/acceptance.py over engine/tree_step.py)
against the host walk it replaces (tree/acceptance.accept), on random trees."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from acceptance_cases import random_step

from vllm_dominotree.engine.acceptance import (
    accept_trees,
    accepted_logprobs,
    draw_targets,
    keyed_exponential,
    step_counters,
)
from vllm_dominotree.engine.commit import drafter_rows_first, moved_rows
from vllm_dominotree.engine.sampling_constraints import path_tokens
from vllm_dominotree.tree.acceptance import accept, sibling_accepts


@pytest.mark.parametrize("seed", range(20))
def test_batched_acceptance_equals_the_host_walk(seed):
    step, host, target, last_rows, _ = random_step(seed)
    width = 13
    got = accept_trees(step, target, last_rows, 7, width)
    trees = {r: tree for r, tree in host}
    accepted = siblings = moves = leaves = 0
    for r in range(7):
        if r not in trees:
            assert got.sampled[r].tolist() == [int(target[last_rows[r]])] + [-1] * (width - 1)
            continue
        first = next(t.logits_row for t in step.trees if t.batch_index == r)
        tree = trees[r]
        path, bonus = accept(tree, target[first : first + tree.num_nodes].tolist())
        tokens = [tree.tokens[n] for n in path] + [bonus]
        assert got.sampled[r].tolist() == tokens + [-1] * (width - len(tokens))
        assert got.path_offsets[r, : len(path)].tolist() == path
        assert int(got.num_accepted[r]) == len(path)
        accepted += len(path)
        siblings += sibling_accepts(tree, path)
        moves += path != list(range(1, len(path) + 1))
        leaves += sum(not children for children in tree.children)
    assert step_counters(step, got).tolist() == [accepted, siblings, moves, leaves]


@pytest.mark.parametrize("seed", range(10))
def test_each_tokens_logprobs_come_from_its_parents_row(seed):
    """Token j of a request is drawn at its path's node j (the root for j = 0): its
    reported logprob is that row's log-softmax at the token, and the best token of that
    row ranks first."""
    step, _, target, last_rows, _ = random_step(seed)
    got = accept_trees(step, target, last_rows, 7, 13)
    logits = torch.randn(step.num_logits, 3, generator=torch.Generator().manual_seed(seed))
    logprobs = accepted_logprobs(logits, got, last_rows[:7], 1)
    want = logits.log_softmax(-1)
    for r in range(7):
        first = int(last_rows[r - 1]) + 1 if r else 0
        k = int(got.num_accepted[r])
        for j, row in enumerate([first] + [first + o for o in got.path_offsets[r, :k].tolist()]):
            token = int(got.sampled[r, j])
            entry = r * 13 + j
            assert logprobs.logprobs[entry, 0] == pytest.approx(float(want[row, token]))
            assert logprobs.logprob_token_ids[entry, 1] == want[row].argmax()


@pytest.mark.parametrize("seed", range(10))
def test_each_rows_path_tokens_are_its_drafted_ancestors(seed):
    """Penalties count, for a tree row, the drafted tokens from the root's child down to
    the row itself (engine/sampling_constraints.path_tokens); none for roots and rows
    outside trees."""
    step, host, _, _, _ = random_step(seed, vocab=50)
    paths = path_tokens(step, pad=50)
    trees = dict(host)
    for row in range(step.num_logits):
        got = sorted(t for t in paths[row].tolist() if t != 50)
        r, offset = int(step.request[row]), int(step.offset[row])
        tree = trees.get(r)
        if tree is None or not step.in_tree[row] or offset >= tree.num_nodes:
            assert got == [], (row, got)
            continue
        node, want = offset, []
        while tree.parents[node] >= 0:
            want.append(tree.tokens[node])
            node = tree.parents[node]
        assert got == sorted(want), (row, got, want)


def test_drafter_rows_follow_the_path_and_positions_stay_unique():
    """After the reorder every request's first 1 + k rows are its root and path, and no
    two rows of a request share a position (the drafter's context slots come from them)."""
    for seed in range(10):
        step, _, target, last_rows, query_start = random_step(seed)
        got = accept_trees(step, target, last_rows, 7, 13)
        ids = torch.arange(1000, 1000 + step.num_tokens)
        tree_positions = torch.arange(step.num_tokens) + step.token_delta
        positions = tree_positions.clone()
        hidden = [torch.arange(step.num_tokens, dtype=torch.float32)[:, None].repeat(1, 3)]
        drafter_rows_first(step, got, ids, positions, hidden)
        assert torch.equal(positions, torch.arange(step.num_tokens))
        for t in step.trees:
            k = int(got.num_accepted[t.batch_index])
            path = got.path_offsets[t.batch_index, :k].tolist()
            keep = [t.token_row + i for i in [0, *path]]
            assert ids[t.token_row : t.token_row + k + 1].tolist() == [1000 + i for i in keep]
            rows = ids[t.token_row : t.token_row + t.num_rows].tolist()
            assert sorted(rows) == list(range(1000 + t.token_row, 1000 + t.token_row + t.num_rows))
            assert hidden[0][t.token_row : t.token_row + k + 1, 0].tolist() == keep
        src, dst = moved_rows(got.path_offsets, got.num_accepted, query_start)
        want = []
        for t in step.trees:
            k = int(got.num_accepted[t.batch_index])
            path = got.path_offsets[t.batch_index, :k].tolist()
            want += [
                (t.token_row + p, t.token_row + 1 + j) for j, p in enumerate(path) if p != j + 1
            ]
        assert list(zip(src.tolist(), dst.tolist(), strict=True)) == want


def test_keyed_noise_is_a_function_of_seed_position_and_token():
    seeds = torch.tensor([3, 3, 4, 3])
    positions = torch.tensor([10, 11, 10, 10])
    noise = keyed_exponential(seeds, positions, 5000, chunk_elements=7000)  # chunked
    assert torch.equal(noise[0], noise[3])  # same key: same noise, whatever the row
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    assert torch.equal(noise, keyed_exponential(seeds, positions, 5000))  # chunks agree
    # Exp(1): mean 1, P(E > 1) = 1/e, and no correlation between keys.
    assert abs(noise.mean().item() - 1) < 0.02
    assert abs((noise > 1).double().mean().item() - math.exp(-1)) < 0.01
    assert abs(torch.corrcoef(noise[:3])[0, 1:].abs().max().item()) < 0.05


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_rows_take_the_first_maximal_logit_as_vllms_sampler(dtype):
    """bfloat16 logits tie often; the greedy draw must take the first maximal index, as
    vLLM's sampler's argmax over float32 logits does (the target alone's token)."""
    torch.manual_seed(0)
    logits = (torch.randn(64, 4096) * 4).round().to(dtype)  # many ties at the maximum
    logits[0, [7, 3000]] = 100.0  # an exact tie, the first at 7
    rows = torch.arange(64)
    greedy = SimpleNamespace(all_greedy=True)
    drawn = draw_targets(logits, rows, [(i, i + 1) for i in range(64)], rows, greedy)
    assert drawn[0] == 7
    assert torch.equal(drawn, logits.float().argmax(dim=-1))
    assert (logits == logits.max(dim=-1, keepdim=True).values).sum(-1).gt(1).any()  # ties
