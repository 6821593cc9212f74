"""Random paged KV caches, batches and trees for the tree-attention kernel, checked
against the dense reference (used by the CPU interpreter test and tests/gpu)."""

from __future__ import annotations

import torch

from vllm_dominotree.kernels.tree_attention import (
    TreeBatchMeta,
    tree_attention,
    tree_attention_reference,
)


def random_tree_masks(sizes: list[int], gen: torch.Generator) -> torch.Tensor:
    """[B, S, S] int8 ancestor-or-self masks of random trees (topological order)."""
    width = max(sizes)
    masks = torch.zeros(len(sizes), width, width, dtype=torch.int8)
    for b, n in enumerate(sizes):
        for i in range(n):
            masks[b, i, i] = 1
            if i:
                masks[b, i] |= masks[b, int(torch.randint(0, i, (1,), generator=gen))]
    return masks


def random_case(device, dtype, seed, heads=8, kv_heads=2, head_dim=64, page=16, trees=3,
                max_context=1100, max_size=40):  # fmt: skip
    """Per request a committed prefix of random length and a random tree right after it;
    the trees' rows are consecutive query rows, with non-tree rows between them; the
    requests' pages are scattered over the cache."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, max_context, (trees,), generator=gen)
    sizes = torch.randint(1, max_size + 1, (trees,), generator=gen)
    max_blocks = int(((starts + sizes).max() + page - 1) // page)
    num_blocks = trees * max_blocks + 3
    perm = torch.randperm(num_blocks, generator=gen)[: trees * max_blocks]
    block_table = perm.view(trees, max_blocks).to(torch.int32)
    key_cache = torch.randn(num_blocks, page, kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks, page, kv_heads, head_dim, generator=gen)
    first_rows, next_row = [], 3
    for n in sizes.tolist():
        first_rows.append(next_row)
        next_row += n + 2  # two non-tree rows after each tree
    query = torch.randn(next_row, heads, head_dim, generator=gen)
    rows = torch.cat([torch.arange(f, f + n) for f, n in zip(first_rows, sizes.tolist(),
                                                             strict=True)])  # fmt: skip

    def on(t, dt=None):
        return t.to(device=device, dtype=dt or t.dtype)

    meta = TreeBatchMeta(
        first_rows=on(torch.tensor(first_rows, dtype=torch.int32)),
        requests=on(torch.arange(trees, dtype=torch.int32)),
        starts=on(starts.to(torch.int32)),
        sizes=on(sizes.to(torch.int32)),
        masks=on(random_tree_masks(sizes.tolist(), gen)),
        rows=on(rows),
        offsets=on((torch.cumsum(sizes, 0) - sizes).to(torch.int32)),
        row_trees=on(torch.repeat_interleave(torch.arange(trees), sizes).to(torch.int32)),
        max_size=int(sizes.max()),
        max_seq_len=int((starts + sizes).max()),
    )
    return (on(query, dtype), on(key_cache, dtype), on(value_cache, dtype),
            on(block_table), meta)  # fmt: skip


def max_error(device: str, dtype: torch.dtype, seed: int, **shape) -> tuple[float, float]:
    """(max |kernel - reference| on tree rows, max change on the other rows)."""
    query, key_cache, value_cache, block_table, meta = random_case(device, dtype, seed, **shape)
    scale = query.shape[-1] ** -0.5
    sentinel = torch.full_like(query, 7.0)
    got, want = sentinel.clone(), sentinel.clone()
    tree_attention(query, key_cache, value_cache, block_table, meta, scale, got)
    tree_attention_reference(query, key_cache, value_cache, block_table, meta, scale, want)
    other = torch.ones(query.shape[0], dtype=torch.bool, device=query.device)
    other[meta.rows] = False
    tree_error = (got[meta.rows].float() - want[meta.rows].float()).abs().max().item()
    untouched = (got[other] - sentinel[other]).abs().max().item()
    return tree_error, untouched
