"""Path requests' checks shared by the CPU tests (test_tree_paths.py, some of them under
Triton's interpreter: the build is a Triton kernel) and tests/gpu: a dense stand-in for
FA3's paged varlen call, the host's reference tables, and the build's checks against
them."""

from __future__ import annotations

import torch
from tree_attention_check import built_path_tables, random_case

from vllm_dominotree.engine.cuda_attention import attend_merged, attend_paths
from vllm_dominotree.engine.tree_paths import (
    PathTables,
    batch_path_specs,
    batch_slot_mapping,
    request_path_specs,
)
from vllm_dominotree.kernels.tree_attention import tree_attention_reference

TABLES = ("seq_used", "query_start", "query_rows", "row_owned", "row_to_query")


def fa3_stand_in(
    *,
    q,
    k,
    v,
    out,
    cu_seqlens_q,
    max_seqlen_q,
    seqused_k,
    max_seqlen_k,
    softmax_scale,
    causal,
    block_table,
    fa_version,
    num_splits,
    return_softmax_lse=False,
    scheduler_metadata=None,
):
    """What vLLM's flash_attn_varlen_func computes for a paged batch, densely in float32:
    request r's keys are its first seqused_k[r] positions through its block table (k's
    pages), its queries q[cu_seqlens_q[r]:cu_seqlens_q[r + 1]]; causal: query i aligned
    to key seqused_k - queries + i. Rows past the last request are left alone.
    return_softmax_lse: also (out, lse [H, total queries], natural log; +inf for a row
    that saw no key, as FA writes it). scheduler_metadata only steers FA3's scheduling
    (tests/gpu checks it gives the same rows); unused here."""
    page, group = k.shape[1], q.shape[1] // k.shape[2]
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"))
    key_slots, value_slots = k.flatten(0, 1), v.flatten(0, 1)  # [slots, KVH, D]
    for r in range(seqused_k.numel()):
        first, end = int(cu_seqlens_q[r]), int(cu_seqlens_q[r + 1])
        keys = int(seqused_k[r])
        if first == end:
            continue
        position = torch.arange(keys)
        slots = block_table[r, position // page].long() * page + position % page
        keys_r = key_slots[slots].float().repeat_interleave(group, dim=1)  # [keys, H, D]
        values_r = value_slots[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,khd->nhk", q[first:end].float(), keys_r) * softmax_scale
        if keys == 0:
            out[first:end] = 0
            continue
        last_key = keys - (end - first) + torch.arange(end - first)
        visible = position[None, :] <= last_key[:, None] if causal else position[None, :] >= 0
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        out[first:end] = torch.einsum("nhk,khd->nhd", scores.softmax(-1), values_r).to(out.dtype)
        lse[:, first:end] = scores.logsumexp(-1).T
    if return_softmax_lse:
        return out, lse.to(q.device)


def publish_case(tables: PathTables, case, each_row: bool = False, every_row: bool = False) -> None:
    _, key_cache, _, block_table, query_start, seq_lens, ancestors, needs_fix = case
    page = key_cache.shape[1]
    specs = batch_path_specs(query_start, seq_lens, ancestors, needs_fix, each_row, every_row)
    assert specs, "the case has no branching tree"
    tables.publish(
        specs, block_table, page, batch_slot_mapping(block_table, query_start, seq_lens, page)
    )


def attend_case(tables: PathTables, case, every_row: bool = False) -> torch.Tensor:
    """The case's fixed rows (every_row: all, one pass's single gather) through
    attend_paths (the runner's gathers and scatter) with the stand-in for FA3; the other
    rows stay 7.0."""
    query, key_cache, value_cache = case[:3]
    got = torch.full_like(query, 7.0)
    attend_paths(
        query,
        key_cache,
        value_cache,
        tables,
        query.shape[-1] ** -0.5,
        17,
        int(case[5].max()),
        got,
        varlen=fa3_stand_in,
        every_row=every_row,
    )
    return got


def reference(case, every_row: bool = False) -> torch.Tensor:
    """The dense reference of the case's fixed rows (every_row: of all its rows); the
    other rows 7.0."""
    want = torch.full_like(case[0], 7.0)
    needs_fix = torch.ones_like(case[-1]) if every_row else case[-1]
    tree_attention_reference(*case[:-1], needs_fix, case[0].shape[-1] ** -0.5, want)
    return want


def merged_inputs(case) -> dict:
    """attend_merged's arguments for a case (one-pass-merge), every row written into a
    fresh `rows` of 7.0. Each row's own K/V are its slot's in the cache, as the forward's
    key and value are."""
    query, key_cache, value_cache, block_table, query_start, seq_lens, ancestors, _ = case
    device, page = query.device, key_cache.shape[1]
    rows = (query_start[1:] - query_start[:-1]).long()
    offset = torch.cat([torch.arange(int(n)) for n in rows]).to(device)
    position = torch.cat(
        [torch.arange(int(s) - int(n), int(s)) for s, n in zip(seq_lens, rows, strict=True)]
    ).to(device)
    request = torch.repeat_interleave(torch.arange(rows.numel(), device=device), rows)
    slots = block_table[request, position // page].long() * page + position % page
    return dict(
        query=query,
        key=key_cache.flatten(0, 1)[slots],
        value=value_cache.flatten(0, 1)[slots],
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=block_table,
        query_start=query_start,
        prefix_lens=(seq_lens - rows).int(),
        max_query_len=int(rows.max()),
        max_seqlen_k=int(seq_lens.max()),
        ancestors=ancestors,
        offset=offset,
        scale=query.shape[-1] ** -0.5,
        rows=torch.full_like(query, 7.0),
    )


def merged_case(case, varlen=None) -> torch.Tensor:
    """Every row of the case through attend_merged: FA3 (varlen, the dense stand-in by
    default) over each request's prefix, then the tree part and the merge in
    kernels/tree_merge.py."""
    inputs = merged_inputs(case)
    attend_merged(**inputs, varlen=varlen or fa3_stand_in)
    return inputs["rows"]


def assert_same_tables(got: PathTables, want: PathTables) -> None:
    for name in TABLES:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    # Each request's keys (its slots up to its key count) are the host's.
    for v, keys in enumerate(want.seq_used.tolist()):
        assert torch.equal(got.slot_table[v, :keys], want.slot_table[v, :keys]), v


def check_build_equals_publish(
    seed: int, requests: int = 6, max_context: int = 90, every_row: bool = False
) -> None:
    """The build's tables are the host's, and give the reference attention (every_row:
    for every row, none left 7.0, and the queries are the forward's rows in order: the
    trees are in preorder, so attend_paths gathers nothing)."""
    case = random_case("cpu", torch.float32, seed, requests=requests, max_context=max_context)
    tokens, max_len = case[0].shape[0], case[3].shape[1] * case[1].shape[1]
    host = PathTables(tokens, tokens, max_len, "cpu")
    publish_case(host, case, every_row=every_row)
    built = built_path_tables(case, PathTables(tokens, tokens, max_len, "cpu"), every_row)
    assert_same_tables(built, host)
    assert built.query_bound >= host.query_bound  # the trees' rows bound the queries
    assert bool(built.row_owned[:tokens].all()) == every_row  # the first request: a root
    if every_row:
        assert built.query_rows[:tokens].tolist() == list(range(tokens))
    got = attend_case(built, case, every_row)
    assert (got - reference(case, every_row)).abs().max() < 1e-5


def check_build_after_a_larger_step() -> None:
    """Tables outlive steps: a small step built over a large one's tables (its scratch
    poisoned too), then a step without trees, which leaves every request empty."""
    large = random_case("cpu", torch.float32, 3, requests=8, max_context=60)
    small = random_case("cpu", torch.float32, 0, requests=2, max_context=60)
    tables = built_path_tables(large)
    assert (attend_case(tables, large) - reference(large)).abs().max() < 1e-5
    tables._counts.fill_(99)
    tables.slot_table.fill_(-5)
    built_path_tables(small, tables)
    assert (attend_case(tables, small) - reference(small)).abs().max() < 1e-5
    tables.build(torch.zeros(3, 0, dtype=torch.long), 17, 0, 0, *([None] * 4), 16, None)
    assert not tables.row_owned.any() and not tables.seq_used.any()
    assert not tables.query_start.any()


def check_runner_build(seed: int) -> None:
    """What the runner hands PathTables.build (the published step's tree rows, per-row
    bits, device positions and slots; requests without trees in between) gives the path
    requests that the host builds from the same trees."""
    from acceptance_cases import random_step

    from vllm_dominotree.engine.tree_step import TreeStepBuffers

    buffers = TreeStepBuffers(128, torch.device("cpu"))
    step, _, _, _, _ = random_step(seed, buffers=buffers)
    page, num_tokens = 4, step.num_tokens
    block_table = torch.randperm(7 * 40, generator=torch.Generator().manual_seed(seed))
    block_table = block_table.view(7, 40).int()  # 7 requests, 160 positions each
    positions = torch.zeros(num_tokens, dtype=torch.long)
    requests = torch.zeros(num_tokens, dtype=torch.long)
    specs = []
    for t in step.trees:
        rows = slice(t.token_row, t.token_row + t.num_rows)
        positions[rows] = t.start + torch.arange(t.num_rows)
        requests[rows] = t.batch_index
        bits = buffers.token_ancestors[rows].numpy()
        fix = buffers.token_needs_fix[rows].numpy() != 0
        specs += request_path_specs(t.batch_index, t.start, t.token_row, bits, fix)
    assert specs, "the step has no branching tree"
    slots = block_table[requests, positions // page].long() * page + positions % page
    host = PathTables(max_paths=64, max_tokens=num_tokens, max_len=160, device="cpu")
    host.publish(specs, block_table, page, slots)
    built = PathTables(max_paths=64, max_tokens=num_tokens, max_len=160, device="cpu")
    built.build(
        buffers.tree_rows(len(step.trees)),
        17,
        num_paths=sum(t.num_rows - 1 for t in step.trees),
        num_keys=max(t.start for t in step.trees) + 17,
        ancestors=buffers.token_ancestors,
        needs_fix=buffers.token_needs_fix,
        positions=positions,
        block_table=block_table,
        block_size=page,
        slot_mapping=slots,
    )
    assert_same_tables(built, host)
