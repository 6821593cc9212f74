"""The CPU tree attention (engine/cpu_attention.py) against a dense reference: the probed
cache layouts read back what vLLM's own writer stored, and the recomputed tree rows see
exactly the prefix, the root and their ancestors. The engine tests check the same path
end to end (greedy output equal to the target alone)."""

from __future__ import annotations

import pytest
import torch
from vllm import _custom_ops as ops

from vllm_dominotree.engine import cpu_attention
from vllm_dominotree.engine.cpu_attention import (
    CacheLayout,
    probe_layout,
    recompute_rows,
    write_cache,
)
from vllm_dominotree.engine.tree_step import TreeRows
from vllm_dominotree.tree.ancestry import ancestor_mask, tree_bits

# (ISA, dtype, block size): vLLM picks vec for block sizes that are multiples of 32 on
# x86 without AMX, vec16 for the others; both run on any x86 CPU. With AMX it picks amx
# for bfloat16, whose layout packs pairs and tiles (cpu_attention.BlockStrides).
LAYOUTS = [
    ("vec", torch.float32, 32),
    ("vec", torch.bfloat16, 128),
    ("vec16", torch.float32, 16),
    pytest.param(
        "amx",
        torch.bfloat16,
        128,
        marks=pytest.mark.skipif(
            not torch.cpu._is_amx_tile_supported(), reason="this CPU has no AMX"
        ),
    ),
]


@pytest.mark.parametrize("isa,dtype,block_size", LAYOUTS)
def test_layout_reads_back_what_the_writer_stored(isa, dtype, block_size):
    heads, dim, num_blocks = 2, 64, 9
    layout = probe_layout(isa, dtype, heads, block_size, dim)
    assert layout.key_strides is not None and layout.value_strides is not None
    gen = torch.Generator().manual_seed(0)
    blocks = torch.tensor([6, 1, 8, 3])
    tokens = len(blocks) * block_size
    keys = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    values = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    kv_cache = torch.zeros(num_blocks, heads, block_size, 2 * dim, dtype=dtype)
    positions = torch.arange(tokens)
    slots = blocks[positions // block_size] * block_size + positions % block_size
    write_cache(kv_cache, isa, keys, values, slots)
    # The strided views and the element offsets they were fitted to give the same.
    generic = CacheLayout(layout.key_offsets, layout.value_offsets, None, None)
    for way in (layout, generic):
        keys_t, got_values = way.read(kv_cache, blocks)  # [n, H, D, bs], [n, H, bs, D]
        assert keys_t.dtype == got_values.dtype == torch.float32
        assert torch.equal(keys_t.permute(0, 3, 1, 2).reshape(tokens, heads, dim), keys.float())
        assert torch.equal(got_values.transpose(1, 2).reshape(tokens, heads, dim), values.float())


def test_packed_layouts_fit_strides_and_scrambled_ones_do_not():
    """AMX's key layout (pairs of dims, tiles of 16 slots), built from its formula so that
    the test runs on CPUs without AMX: the fitted strides read what a gather reads."""
    heads, slots, dims = 2, 64, 8
    h, t, d = torch.meshgrid(
        torch.arange(heads), torch.arange(slots), torch.arange(dims), indexing="ij"
    )
    packed = 5 + h * 1024 + (t // 16) * 256 + (t % 16) * 2 + (d // 2) * 32 + d % 2
    strides = cpu_attention._strides(packed)
    assert (strides.slot_radix, strides.dim_radix) == (16, 2)
    raw = torch.randn(3, 2048)
    view = strides.view(raw, heads, slots, dims).reshape(3, heads, slots, dims)
    assert torch.equal(view, raw[:, packed])
    scrambled = packed.flatten()[
        torch.randperm(packed.numel(), generator=torch.Generator().manual_seed(0))
    ]
    assert cpu_attention._strides(scrambled.view(heads, slots, dims)) is None


def test_a_writer_that_is_not_a_plain_copy_is_refused(monkeypatch):
    class Lossy:
        @staticmethod
        def cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, *args, **kwargs):
            ops.cpu_attn_reshape_and_cache(
                key * 0.5, value, key_cache, value_cache, *args, **kwargs
            )

    monkeypatch.setattr(cpu_attention, "ops", Lossy)
    with pytest.raises(NotImplementedError, match="plain copies"):
        probe_layout.__wrapped__("vec", torch.float32, 2, 32, 64)


def random_parents(n, gen):
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


@pytest.mark.parametrize("isa,dtype,block_size", LAYOUTS)
def test_tree_rows_see_the_prefix_and_their_ancestors(isa, dtype, block_size):
    heads, kv_heads, dim, num_blocks, scale = 6, 2, 64, 40, 0.125
    layout = probe_layout(isa, dtype, kv_heads, block_size, dim)
    gen = torch.Generator().manual_seed(1)
    # Two trees of two requests, each right after its own committed prefix, in one batch
    # behind a plain decode row (row 0).
    starts, sizes = [block_size + 5, 3 * block_size - 2], [17, 9]
    tables = torch.randperm(num_blocks, generator=gen)[:16].view(2, 8).int()
    trees, tree_parents, token_row = [], [], 1
    for b, (start, n) in enumerate(zip(starts, sizes, strict=True)):
        tree_parents.append(random_parents(n, gen))
        trees.append(TreeRows(b, token_row, token_row, start, n, b))
        token_row += n
    tokens = token_row
    query = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    kv_cache = torch.zeros(num_blocks, kv_heads, block_size, 2 * dim, dtype=dtype)
    sequences = []
    for t in trees:  # the prefix and the tree's rows at their linear slots
        length = t.start + t.num_rows
        keys = torch.randn(length, kv_heads, dim, generator=gen).to(dtype)
        values = torch.randn(length, kv_heads, dim, generator=gen).to(dtype)
        pos = torch.arange(length)
        slots = tables[t.batch_index].long()[pos // block_size] * block_size + pos % block_size
        write_cache(kv_cache, isa, keys, values, slots)
        sequences.append((keys, values))
    output = torch.full((tokens, heads * dim), 7.0, dtype=dtype)
    fixes = []
    for t, parents in zip(trees, tree_parents, strict=True):
        ancestors, _, needs_fix = (a[0].numpy() for a in tree_bits(torch.tensor([parents])))
        fix = cpu_attention.tree_fix(t, needs_fix, ancestors, tables[t.batch_index], block_size)
        assert fix is not None
        fixes.append(fix)
    recompute_rows(query, kv_cache, output, fixes, layout, scale)

    fixed = torch.zeros(tokens, dtype=torch.bool)
    for t, parents, fix, (keys, values) in zip(trees, tree_parents, fixes, sequences, strict=True):
        fixed[fix.rows] = True
        sees = torch.ones(t.num_rows, t.start + t.num_rows, dtype=torch.bool)
        sees[:, t.start :] = ancestor_mask(parents)
        group = heads // kv_heads
        k = keys.float().repeat_interleave(group, 1)  # [length, heads, D]
        v = values.float().repeat_interleave(group, 1)
        for i in range(t.num_rows):
            row = t.token_row + i
            if not fixed[row]:
                continue
            scores = torch.einsum("hd,thd->ht", query[row].float(), k) * scale
            scores[:, ~sees[i]] = float("-inf")
            expected = torch.einsum("ht,thd->hd", scores.softmax(-1), v).reshape(-1)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(output[row].float(), expected, atol=tol, rtol=tol)
    # Rows whose causal output was already right (root, chain prefixes, other requests)
    # are not touched.
    assert fixed.sum() > 0 and (output[~fixed] == 7.0).all()
