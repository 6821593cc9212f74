"""The debug check of recomputed tree rows (engine/attention_check.py): a right row
passes, a wrong one is caught with its layer."""

from __future__ import annotations

import torch
from tree_attention_check import random_case

from vllm_dominotree.engine.attention_check import AttentionCheck
from vllm_dominotree.kernels.tree_attention import tree_attention_reference


def test_the_check_measures_recomputed_rows_against_the_reference():
    case = random_case("cpu", torch.float32, 1, requests=4, max_context=80)
    query, needs_fix = case[0], case[-1]
    scale = query.shape[-1] ** -0.5
    rows = torch.zeros_like(query)
    tree_attention_reference(*case, scale, rows)  # what a right recomputation writes
    check = AttentionCheck()
    check.record("layers.0", *case, scale, rows)
    assert check.layers == 1 and check.rows == int(needs_fix.sum()) > 0
    assert check.max_error < 1e-6 and check.max_relative_error < 1e-6
    wrong = int(needs_fix.nonzero()[-1])
    rows[wrong] += 0.5  # a recomputed row off by 0.5
    check.record("layers.1", *case, scale, rows)
    assert abs(check.max_error - 0.5) < 1e-5 and check.worst_layer == "layers.1"
    reference = torch.zeros_like(query)
    tree_attention_reference(*case, scale, reference)
    largest = float(reference[needs_fix.bool()].abs().max())
    assert abs(check.max_relative_error - 0.5 / largest) < 1e-5
    rows[~needs_fix.bool()] = 9.0  # rows left to the stock kernel are not its business
    check.record("layers.2", *case, scale, rows)
    assert check.layers == 3 and check.worst_layer == "layers.1"
