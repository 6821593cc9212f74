"""Domino's per-node step as two Triton launches (kernels/domino_step.py), on the CPU
under Triton's interpreter, in float32: the torch step's states, log-probs and tokens,
and the host heap's trees from the device builder. (The interpreter multiplies bfloat16
tiles wrongly in Triton 3.9, so bfloat16 is checked on the H200: tests/gpu.)"""

from __future__ import annotations

import pytest
import torch
from interpreter import run_interpreted

from vllm_dominotree.demo.toy_pair import random_domino_head
from vllm_dominotree.tree.scorers import ConditionalScorer

CHECKS = """
import torch
from domino_step_checks import (
    check_launch_size_decides_the_table, check_step_matches_torch,
    check_table_gives_the_products, check_trees_equal_heap, check_draft_vocabulary_trees,
    check_chain_equals_heap,
)

# (hidden, GRU, rank, vocabulary, candidates, rows): tiles cut at every edge (hidden not a
# multiple of the reduction step, GRU and rank not of the unit block, a rank below it,
# candidates not a power of two, two row blocks), and the GRU's reduction in eight and in
# four splits (a hidden size of ten float32 reduction steps), with one and two row blocks
shapes = [(72, 40, 24, 300, 64, 5), (40, 16, 8, 50, 49, 3), (24, 20, 36, 120, 32, 20)]
shapes += [(600, 40, 24, 300, 64, 5), (600, 24, 16, 200, 64, 20)]
for shape in shapes:
    check_step_matches_torch(*shape, torch.float32, 1e-4)
# Trees scored at a temperature: 1/T in the tables the kernels read
check_step_matches_torch(*shapes[0], torch.float32, 1e-4, temperature=1.4)
for seed in range(6):
    check_trees_equal_heap(seed)
# Steps of one and two requests: the candidates' table (a GRU reduction in splits too)
for shape in [(72, 40, 24, 300, 64, 1), (600, 24, 16, 200, 49, 2)]:
    check_table_gives_the_products(*shape, torch.float32, 1e-4)
for seed in range(6):
    check_trees_equal_heap(seed, rows=2)
check_launch_size_decides_the_table()
for seed in range(2):
    check_draft_vocabulary_trees(seed)
# Domino's chain on the Triton step: from the table (1, 2 requests) and without (5)
for seed, rows in enumerate([1, 2, 5]):
    check_chain_equals_heap(seed, rows)
print("ok")
"""


def test_triton_step_matches_torch_and_builds_the_heaps_trees():
    out = run_interpreted(CHECKS)
    assert out.count("generation") == 18
    assert out.count("tabled rows") == 2
    assert "8 rows after a prepare of 1" in out
    assert out.count("draft vocabulary:") == 2
    assert out.count("chain of") == 3
    # one shape each, three generations each
    assert out.count("GRU splits 8") == out.count("GRU splits 4") == 3


def test_triton_step_needs_a_top_m_restriction():
    head = random_domino_head(hidden=16, vocab=30, gru_hidden=8, emb_dim=4)
    with pytest.raises(ValueError, match="top-M restriction"):
        ConditionalScorer(
            head,
            torch.zeros(30, 16),
            max_requests=2,
            num_drafts=3,
            budget=4,
            candidates=30,
            max_children=2,
            prefix_len=1,
            kernels=True,
        )
