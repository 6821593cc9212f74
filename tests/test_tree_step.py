"""The step description gathered from the builder's table (engine/tree_step.py), row by
row against the trees themselves, and its capacity-wide gather (the one CUDA captures)
against the step's own."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from acceptance_cases import random_step, table_of

from vllm_dominotree.engine.tree_step import TreeRows, TreeStepBuffers, TreeVerification
from vllm_dominotree.tree.ancestry import tree_bits
from vllm_dominotree.tree.builder import DraftTree


@pytest.mark.parametrize("seed", range(10))
def test_every_tree_row_is_described_from_its_tree(seed):
    buffers = TreeStepBuffers(128, torch.device("cpu"))
    step, host, _, _, _ = random_step(seed, buffers=buffers)
    trees = dict(host)
    fixes = False
    for t in step.trees:
        tree = trees[t.batch_index]
        n = tree.num_nodes
        ancestors, siblings, needs_fix = (a[0] for a in tree_bits(torch.tensor([tree.parents])))
        tok = slice(t.token_row, t.token_row + t.num_rows)
        log = slice(t.logits_row, t.logits_row + t.num_rows)
        assert step.ancestors[log][:n].tolist() == ancestors.tolist()
        assert step.siblings_before[log][:n].tolist() == siblings.tolist()
        assert step.depth[log][:n].tolist() == tree.depths
        assert step.offset[log].tolist() == list(range(t.num_rows))
        assert step.in_tree[log].tolist() == [1] * t.num_rows
        assert step.token[log].tolist() == [-1, *tree.tokens[1:]] + [-1] * (t.num_rows - n)
        parents = [t.logits_row + p for p in tree.parents[1:]]
        assert step.parent_row[log].tolist() == [-1, *parents] + [-1] * (t.num_rows - n)
        assert step.token_delta[tok][:n].tolist() == [d - i for i, d in enumerate(tree.depths)]
        assert buffers.token_ancestors[tok][:n].tolist() == ancestors.tolist()
        assert buffers.token_offset[tok].tolist() == list(range(t.num_rows))
        assert buffers.token_needs_fix[tok].tolist() == needs_fix.long().tolist() + [0] * (
            t.num_rows - n
        )
        fixes |= bool(needs_fix.any())
    # What a CPU runner's one-pass choice reads: some row of the step needs fixing.
    assert buffers.may_fix_rows(step) == fixes and not buffers.may_fix_rows(None)
    # Per tree (what the path requests' build reads): its root row, rows, batch row.
    assert buffers.tree_rows(len(step.trees)).tolist() == [
        [t.token_row for t in step.trees],
        [t.num_rows for t in step.trees],
        [t.batch_index for t in step.trees],
    ]
    # Rows of no tree: never a node, never fixed.
    tree_rows = {r for t in step.trees for r in range(t.logits_row, t.logits_row + t.num_rows)}
    for r in set(range(step.num_logits)) - tree_rows:
        assert step.in_tree[r] == 0 and step.parent_row[r] == -1 and step.token[r] == -1


def test_the_capacity_wide_gather_is_the_steps_own():
    """CUDA replays the gather over every column of the buffers (one captured graph for
    any step): the step's rows must come out as the step's own gather wrote them, and
    the columns past it as rows of no tree."""
    buffers = TreeStepBuffers(96, torch.device("cpu"))
    random_step(5, buffers=buffers)  # a larger earlier step leaves its columns behind
    step, host, _, _, _ = random_step(2, buffers=buffers)
    own = buffers.device_rows.clone()
    buffers._gather(table_of([tree for _, tree in host]), buffers.capacity, buffers.capacity)
    wide = buffers.device_rows
    used = max(step.num_tokens, step.num_logits)
    assert torch.equal(wide[:, :used], own[:, :used])
    assert (step.parent_row >= 0).any()
    rest = buffers.view(buffers.capacity, buffers.capacity)
    assert (rest.parent_row[used:] == -1).all() and (rest.ancestors[used:] == 0).all()
    assert (rest.token_delta[used:] == 0).all() and (rest.in_tree[used:] == 0).all()
    assert (buffers.token_offset[used:] == 0).all()


@pytest.mark.parametrize("seed", range(3))
def test_merged_attention_reads_each_roots_position_as_its_prefix(seed):
    """one-pass-merge: FA3's key count for batch row b is its tree root's position (the
    keys before the root); rows of the buffer past the step's trees, left from a larger
    earlier step, go back to 0 (a graph's padding requests read no key)."""
    buffers = TreeStepBuffers(128, torch.device("cpu"))
    verification = TreeVerification(buffers, frozenset(), 17)
    verification.prefix_lens = torch.full((128,), 99, dtype=torch.int32)
    step, _, _, _, _ = random_step(seed, buffers=buffers)
    positions = torch.randint(0, 1000, (step.num_tokens,))
    verification.publish_prefixes(len(step.trees), positions)
    want = torch.zeros(128, dtype=torch.int32)
    for t in step.trees:
        want[t.batch_index] = positions[t.token_row]
    assert torch.equal(verification.prefix_lens, want)
    assert step.trees and (want[[t.batch_index for t in step.trees]] > 0).any()


def test_a_step_of_chains_has_no_row_to_fix():
    """A CPU runner takes one pass only where some row needs fixing (may_fix_rows): a
    chain's rows see their causal prefix, a branching tree's second child does not."""
    chain = DraftTree([5, 6, 7, 8], [-1, 0, 1, 2], [0, 1, 2, 3], [0.0, -1.0, -2.0, -3.0],
                      [[1], [2], [3], []])  # fmt: skip
    fork = DraftTree([5, 6, 7], [-1, 0, 0], [0, 1, 1], [0.0, -1.0, -2.0], [[1, 2], [], []])
    for tree, fixes in ((chain, False), (fork, True)):
        buffers = TreeStepBuffers(16, torch.device("cpu"))
        rows = TreeRows(0, 0, 0, 100, tree.num_nodes, 0)
        n = rows.num_rows
        step = buffers.publish(
            [rows], n, np.zeros(n, dtype=np.int64), [(0, n)], np.arange(n), table_of([tree])
        )
        assert buffers.may_fix_rows(step) == fixes
