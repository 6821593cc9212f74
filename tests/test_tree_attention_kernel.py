"""The Triton kernels, run by Triton's interpreter on the CPU (the same kernels run
compiled on the H200 in tests/gpu): the tree-row fix-up against the dense reference,
and the one-launch K/V move of accepted paths."""

from __future__ import annotations

import pytest
import torch
from interpreter import run_interpreted
from tree_attention_check import random_case

from vllm_dominotree.kernels.tree_attention import TreeAttention

ATTENTION = """
import torch
from tree_attention_check import max_error
# capacity 4096: key splits + merge; capacity 8: one split, written directly; "triton":
# one split in vLLM's Triton tiles.
cases = [(0, 1100, 4096, "fast"), (1, 1100, 8, "fast"), (2, 300, 4096, "fast")]
cases += [(3, 60, 8, "fast"), (4, 1100, 4096, "triton"), (5, 70, 4096, "triton")]
for seed, context, capacity, rounds_as in cases:
    error, other, fixed = max_error(
        "cpu", torch.float32, seed, capacity, rounds_as, max_context=context
    )
    print(seed, context, capacity, rounds_as, error, other, fixed)
    assert fixed > 0, seed
    assert error < 1e-4, (seed, error)
    assert other == 0, (seed, other)
print("ok")
"""

# The FA3-rounded fix-up in float16 (the interpreter has no bfloat16 products): head dim
# 64 (192-key blocks), 128 (128-key blocks) and 32 (160); short contexts (one block, one split),
# longer ones (a split per block), 6000 keys (FA3's scheduler puts several blocks in a
# split); programs merged in the launch (capacity 4096) or one program (capacity 8).
FA3 = """
import torch
from tree_attention_check import fa3_rounding_agreement
# (seed, context, capacity, head dim, heads, KV heads): groups of 3 (padded) and 4.
cases = [(0, 1100, 4096, 64, 6, 2), (1, 300, 8, 64, 9, 3), (2, 100, 4096, 128, 8, 2)]
cases += [(3, 6000, 4096, 128, 8, 2), (4, 6000, 8, 128, 8, 2)]
# Trees whose roots sit a few keys before a block's end: where a tree key's depth and
# its index in the tree fall into different blocks.
cases += [(5, (189, 380, 125, 185), 4096, 64, 6, 2), (6, (125, 250, 380, 509), 8, 128, 8, 2)]
cases += [(7, (157, 315, 150, 470), 4096, 32, 2, 1)]  # the toy pair's heads: 160-key blocks
for seed, context, capacity, head_dim, heads, kv_heads in cases:
    fixed_contexts = context if isinstance(context, tuple) else None
    found = fa3_rounding_agreement(
        "cpu", torch.float16, seed, capacity, max_context=1 if fixed_contexts else context,
        contexts=fixed_contexts and list(fixed_contexts), head_dim=head_dim,
        heads=heads, kv_heads=kv_heads,
    )
    print(seed, context, capacity, head_dim, found)
    assert found["fixed"] > 0 and found["untouched"], found
    assert found["error"] < 2e-3, found  # right keys and weights: float16 rounding only
    # FA3's steps: a few elements a float16 ulp apart (float32 sums in another order),
    # where blocks of half the size put a third of them apart (contexts past one block).
    assert found["differs"] < 0.06, found
    if fixed_contexts or context > 256:
        assert found["differs_halved"] > 0.2, found
print("ok")
"""

# A FULL graph's padding requests (no rows, no keys) take no part in FA3's split rule:
# the rows come out as without them. The contexts give the step 59 key blocks, where
# FA3's blocks per multiprocessor, ceil(blocks x 1.1 x KV heads / 132), is 1; at 61 (two
# padding requests counted as a block each) it is 2 and every request's split count
# changes, which the reference and the kernel show first (the check can fail).
PADDING = """
import torch
from tree_attention_check import random_case
from vllm_dominotree.kernels.tree_attention import TreeAttention
from vllm_dominotree.kernels.tree_attention_fa3 import fa3_decoding_reference
args = random_case("cpu", torch.float16, 8, head_dim=128, contexts=[1900, 1900, 1900, 1780])
query, block_table, query_start, seq_lens, needs_fix = (args[i] for i in (0, 3, 4, 5, 7))
fixed, scale = needs_fix.bool(), 128 ** -0.5
def run(step, reference=False, **kw):
    out = torch.full_like(query, 7.0)
    (fa3_decoding_reference if reference else kernel)(*step, scale, out, **kw)
    return out[fixed]
kernel = TreeAttention(8, 128, 17, "cpu", 4096, rounds_as="fa3")
assert not torch.equal(run(args, True, batch_blocks=59), run(args, True, batch_blocks=61))
pad = 2
padded = list(args)
padded[3] = torch.cat([block_table, torch.zeros(pad, block_table.shape[1], dtype=torch.int32)])
padded[4] = torch.cat([query_start, query_start[-1:].repeat(pad)])
padded[5] = torch.cat([seq_lens, torch.zeros(pad, dtype=torch.int32)])
got = run(padded)
assert torch.equal(got, run(args, decode_batch_blocks=59))
assert not torch.equal(got, run(args, decode_batch_blocks=61))
print("ok")
"""

MOVE = """
import torch
from vllm_dominotree.kernels.kv_move import PathKVMover
page, blocks = 4, 8
caches = [torch.randn(blocks, 2, page, 16) for _ in range(3)]  # [blocks, kv heads, page, 2D]
before = [c.clone() for c in caches]
# Three requests' rows in the forward, and their slots: request 0 accepts nodes at rows
# 2, 3 (-> rows 1, 2), request 1 accepts row 1 (already in place), request 2 row 3 (-> 1).
slots = torch.tensor([9, 10, 11, 12, 13, 20, 21, 22, 23, 3, 4, 5, 6])
query_start = torch.tensor([0, 5, 9, 13], dtype=torch.int32)
paths = torch.tensor([[2, 3, -1, -1], [1, -1, -1, -1], [3, -1, -1, -1]])
PathKVMover(caches)(slots, query_start, paths, torch.tensor([2, 1, 1]))
moves = {10: 11, 11: 12, 4: 6}
for cache, old in zip(caches, before):
    for s in range(blocks * page):
        want = old[moves.get(s, s) // page, :, moves.get(s, s) % page]
        assert torch.equal(cache[s // page, :, s % page], want), s
print("ok")
"""


def test_tree_rows_match_dense_reference_and_other_rows_are_untouched():
    run_interpreted(ATTENTION)


def test_fa3_rounded_rows_take_fa3s_decoding_steps():
    run_interpreted(FA3)


def test_fa3_rounded_rows_ignore_a_graphs_padding_requests():
    run_interpreted(PADDING)


def test_accepted_paths_move_to_the_rows_after_their_roots():
    run_interpreted(MOVE)


def test_fa3_rounding_refuses_float32_by_name():
    """FA3 runs 16-bit inputs only; float32 tiles of its key blocks exceed an H200's
    shared memory, so the FA3-rounded fix-up says so before any launch."""
    args = random_case("cpu", torch.float32, 0, head_dim=64)
    kernel = TreeAttention(8, 64, 17, "cpu", rounds_as="fa3")
    with pytest.raises(ValueError, match="rounds_as='fa3' takes float16 / bfloat16"):
        kernel(*args, 0.125, torch.empty_like(args[0]))
