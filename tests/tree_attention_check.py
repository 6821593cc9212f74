"""Random paged KV caches, batches and trees for the tree-attention kernel, checked
against the dense reference (used by the CPU interpreter test and tests/gpu)."""

from __future__ import annotations

import torch
from vllm_dominotree.kernels.tree_attention import (
    TreeRowsMeta,
    tree_rows_attention,
    tree_rows_attention_reference,
)


def random_case(device, dtype, seed, heads=8, kv_heads=2, head_dim=64, page=16, requests=3):
    """A batch: per request a committed prefix of random length and a random tree whose
    rows follow it; one query row per tree row; pages scattered over the cache."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, 70, (requests,), generator=gen)
    sizes = torch.randint(1, 18, (requests,), generator=gen)
    max_blocks = int(((starts + sizes).max() + page - 1) // page)
    num_blocks = requests * max_blocks + 3
    perm = torch.randperm(num_blocks, generator=gen)[: requests * max_blocks]
    block_table = perm.view(requests, max_blocks).to(torch.int32)
    key_cache = torch.randn(num_blocks, page, kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks, page, kv_heads, head_dim, generator=gen)
    rows, reqs, row_starts, row_sizes, masks = [], [], [], [], []
    max_size = int(sizes.max())
    total_rows = int(sizes.sum()) + 5  # a few rows that are not tree rows
    next_row = 5
    for r in range(requests):
        n = int(sizes[r])
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
        ancestors = torch.zeros(n, max_size, dtype=torch.int8)
        for i in range(n):
            ancestors[i, i] = 1
            if parents[i] >= 0:
                ancestors[i] |= ancestors[parents[i]]
        for i in range(n):
            rows.append(next_row + i)
            reqs.append(r)
            row_starts.append(int(starts[r]))
            row_sizes.append(n)
            masks.append(ancestors[i])
        next_row += n
    query = torch.randn(total_rows, heads, head_dim, generator=gen)

    def on(t, dt=None):
        return t.to(device=device, dtype=dt or t.dtype)

    meta = TreeRowsMeta(
        rows=on(torch.tensor(rows, dtype=torch.int32)),
        requests=on(torch.tensor(reqs, dtype=torch.int32)),
        starts=on(torch.tensor(row_starts, dtype=torch.int32)),
        sizes=on(torch.tensor(row_sizes, dtype=torch.int32)),
        masks=on(torch.stack(masks)),
    )
    return (on(query, dtype), on(key_cache, dtype), on(value_cache, dtype),
            on(block_table), meta)  # fmt: skip


def max_error(device: str, dtype: torch.dtype, seed: int) -> tuple[float, float]:
    """(max |kernel - reference| on tree rows, max change on the other rows)."""
    query, key_cache, value_cache, block_table, meta = random_case(device, dtype, seed)
    scale = query.shape[-1] ** -0.5
    sentinel = torch.full_like(query, 7.0)
    got, want = sentinel.clone(), sentinel.clone()
    tree_rows_attention(query, key_cache, value_cache, block_table, meta, scale, got)
    tree_rows_attention_reference(query, key_cache, value_cache, block_table, meta, scale, want)
    rows = meta.rows.long()
    other = torch.ones(query.shape[0], dtype=torch.bool, device=query.device)
    other[rows] = False
    tree_error = (got[rows].float() - want[rows].float()).abs().max().item()
    untouched = (got[other] - sentinel[other]).abs().max().item()
    return tree_error, untouched
