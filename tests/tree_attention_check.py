"""Random paged KV caches, batches and trees for the tree-attention kernel, checked
against the dense reference (used by the CPU interpreter test and tests/gpu)."""

from __future__ import annotations

import numpy as np
import torch

from vllm_dominotree.kernels.tree_attention import TreeAttention, tree_attention_reference
from vllm_dominotree.tree.ancestry import in_preorder, tree_bits

# (heads, KV heads, head dim) of the real targets' attention: Qwen3-4B's, and SmolLM2-135M's
# (a group of 3, padded to 4 in the kernels' query tiles).
ATTENTION_SHAPES = {"qwen3-4b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}


def random_case(
    device,
    dtype,
    seed,
    requests=4,
    heads=8,
    kv_heads=2,
    head_dim=64,
    page=16,
    max_context=1100,
    max_rows=17,
    contexts: list[int] | None = None,
    chains: bool = False,
):
    """Per request a committed prefix of random length (or of the lengths `contexts`)
    and a random tree of up to max_rows rows right after it (chains: a chain of
    max_rows rows; the first request is a plain decode row either way); the requests'
    pages are scattered over the cache. Returns the kernel's arguments."""
    gen = torch.Generator().manual_seed(seed)

    def ints(high, low=0):
        return int(torch.randint(low, high, (1,), generator=gen))

    rows = [1] + [max_rows if chains else ints(max_rows + 1, 1) for _ in range(requests - 1)]
    contexts = contexts or [ints(max_context) for _ in rows]
    seq_lens = [c + n for c, n in zip(contexts, rows, strict=True)]
    max_blocks = max((s + page - 1) // page for s in seq_lens)
    num_blocks = requests * max_blocks + 3
    perm = torch.randperm(num_blocks, generator=gen)[: requests * max_blocks]
    block_table = perm.view(requests, max_blocks).to(torch.int32)
    key_cache = torch.randn(num_blocks, page, kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks, page, kv_heads, head_dim, generator=gen)
    num_tokens = sum(rows)
    query = torch.randn(num_tokens, heads, head_dim, generator=gen)
    query_start = torch.tensor([0, *np.cumsum(rows)], dtype=torch.int32)
    ancestors = torch.zeros(num_tokens, dtype=torch.int64)
    needs_fix = torch.zeros(num_tokens, dtype=torch.int64)
    for r, n in enumerate(rows):
        # numbered as a verification step numbers its trees (depth-first preorder)
        parents = torch.tensor([[-1] + [i - 1 if chains else ints(i) for i in range(1, n)]])
        parents = in_preorder(parents, parents, parents)[1]
        bits, _, fix = tree_bits(parents)
        span = slice(int(query_start[r]), int(query_start[r + 1]))
        ancestors[span] = bits[0]
        needs_fix[span] = fix[0].long()

    def on(t, dt=None):
        return t.to(device=device, dtype=dt or t.dtype)

    return (
        on(query, dtype),
        on(key_cache, dtype),
        on(value_cache, dtype),
        on(block_table),
        on(query_start),
        on(torch.tensor(seq_lens, dtype=torch.int32)),
        on(ancestors),
        on(needs_fix),
    )


def bf16_case(shape: str, seed: int, context: int, rows_per_tree: int = 17, **kw) -> tuple:
    """A bfloat16 random_case batch with an ATTENTION_SHAPES shape's heads on the GPU."""
    heads, kv_heads, head_dim = ATTENTION_SHAPES[shape]
    return random_case(
        "cuda",
        torch.bfloat16,
        seed,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        max_context=context,
        max_rows=rows_per_tree,
        **kw,
    )


def max_error(
    device: str,
    dtype: torch.dtype,
    seed: int,
    capacity_rows: int = 4096,
    rounds_as: str = "fast",
    **shape,
) -> tuple[float, float, int]:
    """(max |kernel - reference| on the rows that need a fix, max change on the other rows,
    number of fixed rows). capacity_rows below the batch's rows forces the one-split path;
    rounds_as: the kernel's rounding (TreeAttention).
    The kernel runs twice, as a graph replays it: the splits' counters must be back at
    zero after each launch and the second launch must give the first's rows."""
    args = random_case(device, dtype, seed, **shape)
    query, needs_fix = args[0], args[-1]
    scale = query.shape[-1] ** -0.5
    sentinel = torch.full_like(query, 7.0)
    got, want = sentinel.clone(), sentinel.clone()
    kernel = TreeAttention(
        query.shape[1],
        query.shape[2],
        shape.get("max_rows", 17),
        query.device,
        capacity_rows=capacity_rows,
        rounds_as=rounds_as,
    )
    kernel(*args, scale, got)
    assert not kernel.counters.any(), "a launch left split counters behind"
    again = sentinel.clone()
    kernel(*args, scale, again)
    assert not kernel.counters.any() and torch.equal(again, got), "a second launch differs"
    tree_attention_reference(*args, scale, want)
    fixed = needs_fix.bool()
    error = (got[fixed].float() - want[fixed].float()).abs().max().item()
    untouched = (got[~fixed] - sentinel[~fixed]).abs().max().item()
    return error, untouched, int(fixed.sum())


def path_tables(args, each_row: bool, every_row: bool = False, max_tokens: int = 0):
    """A random_case batch's path requests (engine/tree_paths.py) published into device
    tables. each_row: one request per fixed row (FA3's one-token decoding of its path);
    every_row: requests that hold every row (one pass); max_tokens: the forward rows the
    tables hold, the batch's unless more (a forward with rows after the trees')."""
    from vllm_dominotree.engine.tree_paths import (
        PathTables,
        batch_path_specs,
        batch_slot_mapping,
    )

    query, key_cache, _, block_table, query_start, seq_lens, ancestors, needs_fix = args
    page = key_cache.shape[1]
    rows = max(max_tokens, query.shape[0])
    tables = PathTables(query.shape[0], rows, block_table.shape[1] * page, query.device)
    tables.publish(
        batch_path_specs(query_start, seq_lens, ancestors, needs_fix, each_row, every_row),
        block_table,
        page,
        batch_slot_mapping(block_table, query_start, seq_lens, page),
    )
    return tables


def path_build_inputs(args, max_len: int, max_rows: int = 17, every_row: bool = False) -> dict:
    """PathTables.build's arguments for a random_case batch: what the runner hands it
    (per-row bits, positions and slots, the trees' rows, host bounds). every_row: every
    row a query (one pass; a tree of the root alone has one path)."""
    from vllm_dominotree.engine.tree_paths import batch_slot_mapping

    query, key_cache, _, block_table, query_start, seq_lens, ancestors, needs_fix = args
    page = key_cache.shape[1]
    rows = query_start[1:] - query_start[:-1]
    trees = torch.stack([query_start[:-1], rows, torch.arange(rows.numel(), device=rows.device)])
    positions = torch.cat(
        [
            torch.arange(int(s) - int(n), int(s), device=query.device)
            for s, n in zip(seq_lens, rows, strict=True)
        ]
    )
    return dict(
        trees=trees.long(),
        rows_per_tree=max_rows,
        num_paths=int((rows - 1).clamp(min=int(every_row)).sum()),
        num_keys=min(int(seq_lens.max()) + max_rows, max_len),
        ancestors=ancestors,
        needs_fix=needs_fix,
        positions=positions,
        block_table=block_table,
        block_size=page,
        slot_mapping=batch_slot_mapping(block_table, query_start, seq_lens, page),
        every_row=every_row,
    )


def built_path_tables(args, tables=None, every_row: bool = False):
    """The batch's path requests built on the device side (PathTables.build), into
    `tables` if given (the runner rebuilds its own every step)."""
    from vllm_dominotree.engine.tree_paths import PathTables

    query, block_table, page = args[0], args[3], args[1].shape[1]
    tables = tables or PathTables(128, query.shape[0], block_table.shape[1] * page, query.device)
    tables.build(**path_build_inputs(args, tables.max_len, every_row=every_row))
    return tables


def paths_output(
    args,
    each_row: bool,
    max_rows: int = 17,
    tables=None,
    max_seqlen_k: int | None = None,
    num_splits: int = 0,
    every_row: bool = False,
) -> torch.Tensor:
    """A random_case batch's fixed rows through FA3 over path requests (CUDA;
    engine/tree_paths.py), the other rows left at 7.0 (tables: path_tables', made here
    unless given; max_seqlen_k: the batch's longest sequence unless given; num_splits:
    FA3's, 0 its own heuristic, the engine's under FULL graphs vLLM's bound; every_row:
    tables that own every row, which FA3 writes in place: one pass)."""
    from vllm_dominotree.engine.cuda_attention import attend_paths

    query, key_cache, value_cache = args[:3]
    tables = tables or path_tables(args, each_row, every_row)
    longest = int(args[5].max()) if max_seqlen_k is None else max_seqlen_k
    out = torch.full_like(query, 7.0)
    scale = query.shape[-1] ** -0.5
    attend_paths(
        query,
        key_cache,
        value_cache,
        tables,
        scale,
        max_rows,
        longest,
        out,
        num_splits=num_splits,
        every_row=every_row,
    )
    return out


def vllm_decode_output(args, page: int = 16, num_splits: int = 32) -> torch.Tensor:
    """Each fixed row of a random_case batch decoded as vLLM's FA3 backend decodes a
    token (CUDA): one one-token request per fixed row over its own path, copied into a
    fresh cache of `page`-slot pages (vLLM's block size), FA3 called with max_seqlen_q 1
    and the ahead-of-time scheduler metadata that vLLM's metadata builder computes
    (get_scheduler_metadata, the split bound of its FULL graphs). The other rows are
    left at 7.0. The engine's bf16 test compares against the target alone decoding so."""
    from vllm.v1.attention.backends.fa_utils import (
        flash_attn_varlen_func,
        get_scheduler_metadata,
    )

    query, key_cache, value_cache, block_table, query_start, seq_lens, ancestors, needs_fix = args
    cache_page, kv_heads, head_dim = key_cache.shape[1], key_cache.shape[2], key_cache.shape[3]
    rows, keys, values = [], [], []
    for r in range(seq_lens.numel()):
        first, end = int(query_start[r]), int(query_start[r + 1])
        start = int(seq_lens[r]) - (end - first)
        positions = torch.arange(int(seq_lens[r]), device=query.device)
        slots = block_table[r, positions // cache_page].long() * cache_page + positions % cache_page
        for i in range(first, end):
            if not needs_fix[i]:
                continue
            bits = int(ancestors[i])
            path = [0] + [t for t in range(1, end - first) if bits >> (t - 1) & 1]
            order = torch.cat([torch.arange(start), start + torch.tensor(path)])
            picked = slots[order.to(slots.device)]
            rows.append(i)
            keys.append(key_cache.flatten(0, 1)[picked])
            values.append(value_cache.flatten(0, 1)[picked])
    lengths = torch.tensor([k.shape[0] for k in keys], dtype=torch.int32, device=query.device)
    pages = (lengths + page - 1) // page
    table = torch.zeros(len(rows), int(pages.max()), dtype=torch.int32, device=query.device)
    k_new = query.new_zeros(int(pages.sum()), page, kv_heads, head_dim)
    v_new = torch.zeros_like(k_new)
    used = 0
    for n, (k, v) in enumerate(zip(keys, values, strict=True)):
        count = int(pages[n])
        table[n, :count] = torch.arange(used, used + count, device=query.device)
        k_new.flatten(0, 1)[used * page : used * page + k.shape[0]] = k
        v_new.flatten(0, 1)[used * page : used * page + v.shape[0]] = v
        used += count
    cu_q = torch.arange(len(rows) + 1, dtype=torch.int32, device=query.device)
    metadata = get_scheduler_metadata(
        batch_size=len(rows),
        max_seqlen_q=1,
        max_seqlen_k=int(lengths.max()),
        num_heads_q=query.shape[1],
        num_heads_kv=kv_heads,
        headdim=head_dim,
        cache_seqlens=lengths,
        qkv_dtype=query.dtype,
        cu_seqlens_q=cu_q,
        page_size=page,
        causal=True,
        window_size=(-1, -1),
        num_splits=num_splits,
    )
    decoded = torch.empty(len(rows), *query.shape[1:], dtype=query.dtype, device=query.device)
    flash_attn_varlen_func(
        q=query[rows].contiguous(),
        k=k_new,
        v=v_new,
        out=decoded,
        cu_seqlens_q=cu_q,
        max_seqlen_q=1,
        seqused_k=lengths,
        max_seqlen_k=int(lengths.max()),
        softmax_scale=head_dim**-0.5,
        causal=True,
        block_table=table,
        scheduler_metadata=metadata,
        fa_version=3,
        num_splits=num_splits,
    )
    out = torch.full_like(query, 7.0)
    out[rows] = decoded
    return out


def decode_batch_blocks(args, block_n: int) -> int:
    """FA3's key blocks for decoding a random_case batch's fixed rows, each as its own
    one-token request over its path (paths_output with each_row): what its scheduler
    sizes that pass's splits by."""
    query_start, seq_lens, ancestors, needs_fix = args[4], args[5], args[6], args[7]
    total = 0
    for r in range(seq_lens.numel()):
        first, end = int(query_start[r]), int(query_start[r + 1])
        start = int(seq_lens[r]) - (end - first)
        for i in range(first, end):
            if needs_fix[i]:
                length = start + 1 + bin(int(ancestors[i])).count("1")
                total += -(-length // block_n)
    return total


def fa3_rounding_agreement(device, dtype, seed, capacity_rows=4096, **shape) -> dict:
    """The FA3-rounded fix-up (kernels/tree_attention_fa3.py) on a random_case batch:
    its error against the dense reference, whether rows that need no fix were left alone,
    and the share of the fixed rows' output elements that differ from FA3's decoding as
    fa3_decoding_reference computes it in torch, and from that reference with blocks of
    half the size (what a wrong block split looks like)."""
    from vllm_dominotree.kernels.tree_attention_fa3 import fa3_block_n, fa3_decoding_reference

    args = random_case(device, dtype, seed, **shape)
    query, needs_fix = args[0], args[-1]
    scale = query.shape[-1] ** -0.5
    fixed = needs_fix.bool()
    sentinel = torch.full_like(query, 7.0)
    got, dense, emulated, halved = (sentinel.clone() for _ in range(4))
    kernel = TreeAttention(
        query.shape[1], query.shape[2], 17, query.device, capacity_rows, rounds_as="fa3"
    )
    kernel(*args, scale, got)
    assert not kernel.counters.any(), "a launch left split counters behind"
    tree_attention_reference(*args, scale, dense)
    fa3_decoding_reference(*args, scale, emulated, num_sms=kernel.num_sms)
    block_n = fa3_block_n(query.shape[2])
    fa3_decoding_reference(*args, scale, halved, num_sms=kernel.num_sms, block_n=block_n // 2)
    return {
        "fixed": int(fixed.sum()),
        "error": (got[fixed].float() - dense[fixed].float()).abs().max().item(),
        "untouched": bool((got[~fixed] == 7.0).all()),
        "differs": (got[fixed] != emulated[fixed]).float().mean().item(),
        "differs_halved": (got[fixed] != halved[fixed]).float().mean().item(),
    }
