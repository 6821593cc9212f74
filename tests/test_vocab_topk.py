"""The vocabulary's top M by kernels/vocab_topk.py (DOMINOTREE_VOCAB_TOPK=triton) under
Triton's interpreter, against a stable sort (larger value first, equal values by
smaller index): Qwen3's vocabulary and shorter rows, bf16 / float16 / float32, ties
inside a block, across blocks and at the boundary of the top M, blocks with fewer than
M logits; and the scorers' preparation through it."""

from __future__ import annotations

from interpreter import run_interpreted


def test_the_kernel_gives_the_stable_sorts_top():
    run_interpreted("""
import torch
from vllm_dominotree.kernels.vocab_topk import BLOCK, vocab_topk

def stable_top(x, m):
    order = torch.argsort(-x.float(), dim=-1, stable=True)[..., :m]
    return torch.gather(x, -1, order), order

g = torch.Generator().manual_seed(0)
shapes = ((2, 151936, 64), (3, 100, 64), (2, 2 * BLOCK + 5, 128), (2, 512, 7), (1, 64, 64))
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for rows, vocab, m in shapes:
        x = torch.randn(rows, vocab, generator=g).to(dtype)
        x[:, 5:40] = x[:, 3:4]  # equal values in one block
        x[0, -50:] = 30.0  # across blocks, more than fit at the boundary when m < 50
        x[-1, ::97] = -2.0  # the boundary inside the top
        values, index = vocab_topk(x, m)
        want_values, want_index = stable_top(x, m)
        assert torch.equal(values, want_values), (dtype, vocab, m)
        assert torch.equal(index, want_index), (dtype, vocab, m)
        assert torch.equal(values, x.topk(m, -1).values)  # torch.topk's values
# [R, K, V] as prepare passes them
x = torch.randn(2, 3, 5000, generator=g, dtype=torch.bfloat16)
values, index = vocab_topk(x, 16)
assert values.shape == index.shape == (2, 3, 16)
assert torch.equal(torch.gather(x, -1, index), values)
print("ok")
""")


def test_a_wrong_tie_rule_is_seen():
    run_interpreted("""
import torch
from vllm_dominotree.kernels.vocab_topk import vocab_topk

x = torch.zeros(1, 300)
x[0, 10], x[0, 200] = 1.0, 1.0
values, index = vocab_topk(x, 3)
assert index.tolist() == [[10, 200, 0]], index  # equal values: the smaller index first
assert values.tolist() == [[1.0, 1.0, 0.0]]
print("ok")
""")


def test_the_marginal_scorer_prepares_the_same_tables_through_the_kernel():
    """Without equal logits both ways give the same children tables (the top C per
    depth and their log-probs)."""
    run_interpreted("""
import torch
from vllm_dominotree.tree.scorers import MarginalScorer

g = torch.Generator().manual_seed(1)
logits = torch.randn(3, 15, 3000, generator=g)  # distinct values
tables = []
for kind in ("torch", "triton"):
    scorer = MarginalScorer(8, max_requests=4, num_drafts=15, vocab=3000,
                            device=torch.device("cpu"), vocab_topk=kind)
    scorer.prepare(None, logits)
    tables.append((scorer.logprobs[:3].clone(), scorer.tokens[:3].clone()))
assert torch.equal(tables[0][0], tables[1][0]) and torch.equal(tables[0][1], tables[1][1])
assert tables[0][1].unique().numel() > 8
print("ok")
""")
