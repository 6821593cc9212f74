"""The CPU tree attention (engine/cpu_attention.py) against a dense reference: the path
requests give every recomputed tree row exactly the prefix, the root and its ancestors,
through vLLM's own kernel, for each cache layout vLLM's CPU backend uses. The engine
tests check the same path end to end (greedy output equal to the target alone)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_dominotree.engine.cpu_attention import path_batch, recompute_rows, write_cache
from vllm_dominotree.engine.tree_step import TreeRows
from vllm_dominotree.tree.ancestry import ancestor_mask, tree_bits

# (ISA, dtype, block size): vLLM picks vec for block sizes that are multiples of 32 on
# x86 without AMX, vec16 for the others; both run on any x86 CPU. With AMX it picks amx
# for bfloat16, whose layout packs pairs of dims and of slots.
LAYOUTS = [
    ("vec", torch.float32, 32),
    ("vec", torch.bfloat16, 128),
    ("vec16", torch.float32, 16),
    pytest.param(
        "amx",
        torch.bfloat16,
        128,
        marks=pytest.mark.skipif(not torch.cpu._init_amx(), reason="this CPU has no AMX"),
    ),
]


def bits_and_fixes(parents: list[int]) -> tuple[np.ndarray, np.ndarray]:
    ancestors, _, needs_fix = tree_bits(torch.tensor([parents]))
    return ancestors[0].numpy(), needs_fix[0].numpy()


def test_each_fixed_row_is_asked_once_by_the_first_path_through_it():
    # root - 1 - 3 and root - 2 - 4: rows 2, 3, 4 see other than their causal prefix.
    parents = [-1, 0, 0, 1, 2]
    ancestors, needs_fix = bits_and_fixes(parents)
    assert needs_fix.tolist() == [False, False, True, True, True]
    block_size, start, token_row = 32, 70, 3  # the root sits in the request's third block
    tree = TreeRows(0, token_row, token_row, start, len(parents), 0)
    table = torch.tensor([11, 12, 13, 14], dtype=torch.int32)
    paths = path_batch([(tree, needs_fix, ancestors, table)], block_size)
    # Path 0-1-3 asks for row 3 only (row 1 is causal); path 0-2-4 for rows 2 and 4.
    assert (paths.query_rows - token_row).tolist() == [3, 2, 4]
    assert paths.query_start_loc.tolist() == [0, 1, 3]
    assert paths.seq_lens.tolist() == [start + 3, start + 3]
    # The prefix's two blocks are copied once, each path copies the root's block.
    assert paths.source_blocks.tolist() == [11, 12, 13, 13]
    assert paths.block_table.tolist() == [[0, 1, 2], [0, 1, 3]]
    # Each path's rows go to the positions after the root in its own block copy.
    assert (paths.kv_rows - token_row).tolist() == [1, 3, 2, 4]
    # Positions 71 and 72 are slots 7 and 8 of a block.
    slots = [2 * block_size + 7, 2 * block_size + 8, 3 * block_size + 7, 3 * block_size + 8]
    assert paths.kv_slots.tolist() == slots


def test_one_pass_asks_every_row_once_the_root_by_the_first_path():
    parents = [-1, 0, 0, 1, 2]
    ancestors, needs_fix = bits_and_fixes(parents)
    tree = TreeRows(0, 3, 3, 70, len(parents), 0)
    table = torch.tensor([11, 12, 13, 14], dtype=torch.int32)
    paths = path_batch([(tree, needs_fix, ancestors, table)], 32, every_row=True)
    assert (paths.query_rows - 3).tolist() == [0, 1, 3, 2, 4]
    assert paths.query_start_loc.tolist() == [0, 3, 5]
    assert (paths.kv_rows - 3).tolist() == [1, 3, 2, 4]  # the root's K/V is in its block


def test_no_path_requests_for_chains():
    parents = [-1, 0, 1, 2]
    ancestors, needs_fix = bits_and_fixes(parents)
    tree = TreeRows(0, 0, 0, 5, len(parents), 0)
    table = torch.tensor([1], dtype=torch.int32)
    assert path_batch([(tree, needs_fix, ancestors, table)], 32) is None


def random_parents(n, gen):
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


@pytest.mark.parametrize("every_row", [False, True], ids=["fixed-rows", "one-pass"])
@pytest.mark.parametrize("isa,dtype,block_size", LAYOUTS)
def test_tree_rows_see_the_prefix_and_their_ancestors(isa, dtype, block_size, every_row):
    """The rows that need fixing, or in one pass (no stock pass) every tree row, each
    computed once, against the dense reference; the other rows are not written."""
    heads, kv_heads, dim, num_blocks, scale = 6, 2, 64, 40, 0.125
    impl = SimpleNamespace(
        num_heads=heads, num_kv_heads=kv_heads, head_size=dim, scale=scale, kv_cache_dtype="auto"
    )
    gen = torch.Generator().manual_seed(1)
    # Two trees of two requests, each right after its own committed prefix, in one batch
    # behind a plain decode row (row 0); the second tree crosses a block boundary.
    starts, sizes = [block_size + 5, 3 * block_size - 2], [17, 9]
    tables = torch.randperm(num_blocks, generator=gen)[:16].view(2, 8).int()
    trees, tree_parents, token_row = [], [], 1
    for b, (start, n) in enumerate(zip(starts, sizes, strict=True)):
        tree_parents.append(random_parents(n, gen))
        trees.append(TreeRows(b, token_row, token_row, start, n, b))
        token_row += n
    tokens = token_row
    query = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    key = torch.randn(tokens, kv_heads, dim, generator=gen).to(dtype)
    value = torch.randn(tokens, kv_heads, dim, generator=gen).to(dtype)
    kv_cache = torch.zeros(num_blocks, kv_heads, block_size, 2 * dim, dtype=dtype)
    sequences = []
    for t in trees:  # the prefix, then the tree's rows at their linear slots
        keys = torch.randn(t.start + t.num_rows, kv_heads, dim, generator=gen).to(dtype)
        values = torch.randn(t.start + t.num_rows, kv_heads, dim, generator=gen).to(dtype)
        rows = slice(t.token_row, t.token_row + t.num_rows)
        keys[t.start :], values[t.start :] = key[rows], value[rows]
        pos = torch.arange(len(keys))
        slots = tables[t.batch_index].long()[pos // block_size] * block_size + pos % block_size
        write_cache(kv_cache, isa, keys, values, slots)
        sequences.append((keys, values))
    before = kv_cache.clone()
    described = []
    for t, parents in zip(trees, tree_parents, strict=True):
        ancestors, needs_fix = bits_and_fixes(parents)
        described.append((t, needs_fix, ancestors, tables[t.batch_index]))
    paths = path_batch(described, block_size, every_row)
    assert len(set(paths.query_rows.tolist())) == len(paths.query_rows)  # each row once
    output = torch.full((tokens, heads * dim), 7.0, dtype=dtype)
    recompute_rows(impl, isa, query, key, value, kv_cache, output, paths)
    assert torch.equal(kv_cache, before)  # path requests run on a scratch copy

    fixed = torch.zeros(tokens, dtype=torch.bool)
    fixed[paths.query_rows] = True
    for t, parents, (keys, values) in zip(trees, tree_parents, sequences, strict=True):
        _, needs_fix = bits_and_fixes(parents)
        wanted = np.ones_like(needs_fix) if every_row else needs_fix
        assert fixed[t.token_row : t.token_row + t.num_rows].tolist() == wanted.tolist()
        sees = torch.ones(t.num_rows, t.start + t.num_rows, dtype=torch.bool)
        sees[:, t.start :] = ancestor_mask(parents)
        group = heads // kv_heads
        k = keys.float().repeat_interleave(group, 1)  # [length, heads, D]
        v = values.float().repeat_interleave(group, 1)
        for i in np.nonzero(wanted)[0]:
            row = t.token_row + i
            scores = torch.einsum("hd,thd->ht", query[row].float(), k) * scale
            scores[:, ~sees[i]] = float("-inf")
            expected = torch.einsum("ht,thd->hd", scores.softmax(-1), v).reshape(-1)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(output[row].float(), expected, atol=tol, rtol=tol)
    # Rows whose causal output was already right (root, chain prefixes) unless in one
    # pass, and rows of other requests (row 0), are not touched.
    assert fixed.sum() > 0 and (output[~fixed] == 7.0).all() and not fixed[0]
