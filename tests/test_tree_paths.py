"""Tree rows as causal path requests (engine/tree_paths.py): every fixed row owned once,
and the path requests, run through a dense stand-in for FA3's paged varlen causal call
(pages of one slot, queries aligned to the end of their keys), give the tree attention
of the dense reference. tests/gpu runs the same tables through FA3 itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tree_attention_check import built_path_tables, random_case

from vllm_dominotree.config import attention_mode
from vllm_dominotree.engine.cuda_attention import attend_paths
from vllm_dominotree.engine.tree_paths import (
    PathTables,
    batch_path_specs,
    batch_slot_mapping,
    slot_view,
    split_into_paths,
)
from vllm_dominotree.kernels.tree_attention import tree_attention_reference
from vllm_dominotree.tree.ancestry import tree_bits


def random_tree(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.array([-1] + [int(rng.integers(i)) for i in range(1, n)])


@pytest.mark.parametrize("seed", range(40))
def test_every_fixed_row_is_owned_once_at_the_end_of_its_path(seed):
    rng = np.random.default_rng(seed)
    parents = random_tree(rng, int(rng.integers(1, 18)))
    ancestors, _, needs_fix = (a[0].numpy() for a in tree_bits(torch.from_numpy(parents[None])))
    paths = split_into_paths(ancestors, needs_fix)
    owned = [row for path, k in paths for row in path[len(path) - k :]]
    assert sorted(owned) == [i for i in range(len(parents)) if needs_fix[i]]
    for path, k in paths:
        leaf = path[-1]
        walk, node = [], leaf
        while node > 0:  # the leaf's ancestors, from depth 1
            walk.insert(0, node)
            node = parents[node]
        assert path == walk and 0 < k <= len(path)
        assert leaf not in parents  # a leaf
        # Rows before the owned ones are covered: the stock pass's or an earlier path's.
        assert all(not needs_fix[j] or j in owned[: owned.index(path[-k])] for j in path[:-k])


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
):
    """What vLLM's flash_attn_varlen_func computes for a paged causal batch, densely in
    float32: request r's keys are its first seqused_k[r] positions through its block
    table (k's pages), its queries q[cu_seqlens_q[r]:cu_seqlens_q[r + 1]], query i
    aligned to key seqused_k - queries + i. Rows past the last request are left alone."""
    assert causal
    page, group = k.shape[1], q.shape[1] // k.shape[2]
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
        last_key = keys - (end - first) + torch.arange(end - first)
        visible = position[None, :] <= last_key[:, None]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        out[first:end] = torch.einsum("nhk,khd->nhd", scores.softmax(-1), values_r).to(out.dtype)


def publish_case(tables: PathTables, case, each_row: bool = False) -> None:
    _, key_cache, _, block_table, query_start, seq_lens, ancestors, needs_fix = case
    page = key_cache.shape[1]
    specs = batch_path_specs(query_start, seq_lens, ancestors, needs_fix, each_row)
    assert specs, "the case has no branching tree"
    tables.publish(
        specs, block_table, page, batch_slot_mapping(block_table, query_start, seq_lens, page)
    )


def attend_case(tables: PathTables, case) -> torch.Tensor:
    """The case's fixed rows through attend_paths (the runner's gathers and scatter)
    with the stand-in for FA3; the other rows stay 7.0."""
    query, key_cache, value_cache = case[:3]
    got = torch.full_like(query, 7.0)
    attend_paths(
        query,
        key_cache,
        value_cache,
        tables,
        query.shape[-1] ** -0.5,
        17,
        got,
        varlen=fa3_stand_in,
    )
    return got


def reference(case) -> torch.Tensor:
    want = torch.full_like(case[0], 7.0)
    tree_attention_reference(*case, case[0].shape[-1] ** -0.5, want)
    return want


@pytest.mark.parametrize("each_row", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_path_requests_give_the_tree_attention(seed, each_row):
    case = random_case("cpu", torch.float32, seed, requests=5, max_context=90)
    query, needs_fix = case[0], case[-1]
    tables = PathTables(max_paths=64, max_tokens=query.shape[0], max_len=2048, device="cpu")
    publish_case(tables, case, each_row)
    assert torch.equal(tables.row_owned[: query.shape[0]], needs_fix.bool())
    assert (attend_case(tables, case) - reference(case)).abs().max() < 1e-5
    # The next step without paths leaves every request empty.
    tables.publish([], case[3], case[1].shape[1], torch.zeros(query.shape[0], dtype=torch.long))
    assert not tables.row_owned.any() and not tables.seq_used.any()


def test_a_smaller_step_after_a_larger_one():
    """The tables outlive steps: a step of few rows after one of many must not gather
    through the larger step's row maps (FA3 reads every forward row's entry)."""
    large = random_case("cpu", torch.float32, 3, requests=8, max_context=60)
    small = random_case("cpu", torch.float32, 0, requests=2, max_context=60)
    tables = PathTables(max_paths=128, max_tokens=large[0].shape[0], max_len=2048, device="cpu")
    publish_case(tables, large)
    assert int(tables.query_rows.max()) >= small[0].shape[0]  # rows the small step lacks
    assert (attend_case(tables, large) - reference(large)).abs().max() < 1e-5
    publish_case(tables, small)
    assert (attend_case(tables, small) - reference(small)).abs().max() < 1e-5


def test_a_layout_without_a_uniform_slot_stride_is_refused():
    # vLLM's [blocks, page, kv heads, 2 D] split into K and V: block stride = page slots.
    keys = torch.zeros(4, 8, 2, 32)[..., :16]
    assert slot_view(keys).shape == (32, 1, 2, 16)
    assert slot_view(keys).data_ptr() == keys.data_ptr()
    heads_first = torch.zeros(4, 2, 8, 16).transpose(1, 2)  # [blocks, page, heads, D] view
    with pytest.raises(NotImplementedError, match="one-slot page view"):
        slot_view(heads_first)


def test_the_attention_mode_is_checked(monkeypatch):
    assert attention_mode() == "auto"  # paths where the target runs FA3, else fixup
    monkeypatch.setenv("DOMINOTREE_CUDA_TREE_ATTENTION", "fixup")
    assert attention_mode() == "fixup"
    monkeypatch.setenv("DOMINOTREE_CUDA_TREE_ATTENTION", "paths")
    assert attention_mode() == "paths"
    monkeypatch.setenv("DOMINOTREE_CUDA_TREE_ATTENTION", "fa3")
    with pytest.raises(ValueError, match="DOMINOTREE_CUDA_TREE_ATTENTION='fa3'; use one of"):
        attention_mode()


@pytest.mark.parametrize("seed", range(8))
def test_tables_built_on_the_device_side_equal_the_hosts(seed):
    case = random_case("cpu", torch.float32, seed, requests=6, max_context=90)
    tokens = case[0].shape[0]
    host = PathTables(128, tokens, case[3].shape[1] * case[1].shape[1], "cpu")
    publish_case(host, case)
    device = built_path_tables(case)
    for name in ("seq_used", "query_start", "query_rows", "row_owned", "row_to_query"):
        assert torch.equal(getattr(device, name), getattr(host, name)), name
    # Each request's keys (its slots up to its key count) are the host's.
    for v, keys in enumerate(host.seq_used.tolist()):
        assert torch.equal(device.slot_table[v, :keys], host.slot_table[v, :keys]), v
    assert (attend_case(device, case) - reference(case)).abs().max() < 1e-5


def test_a_built_step_after_a_larger_one_and_a_step_without_trees():
    large = random_case("cpu", torch.float32, 3, requests=8, max_context=60)
    small = random_case("cpu", torch.float32, 0, requests=2, max_context=60)
    tables = built_path_tables(large)
    assert (attend_case(tables, large) - reference(large)).abs().max() < 1e-5
    tables._path_tree.fill_(99)  # whatever an earlier step left: no tree of this one
    built_path_tables(small, tables)
    assert (attend_case(tables, small) - reference(small)).abs().max() < 1e-5
    tables.build(torch.zeros(3, 0, dtype=torch.long), 17, 0, 0, *([None] * 4), 16, None)
    assert not tables.row_owned.any() and not tables.seq_used.any()
    assert not tables.query_start.any()


@pytest.mark.parametrize("seed", range(6))
def test_the_runners_build_from_a_step_description_equals_the_host_paths(seed):
    """What the runner hands PathTables.build (the published step's tree rows, per-row
    bits, device positions and slots; requests without trees in between) gives the path
    requests that the host built from the same trees before the build existed."""
    from acceptance_cases import random_step

    from vllm_dominotree.engine.tree_paths import request_path_specs
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
    for name in ("seq_used", "query_start", "query_rows", "row_owned", "row_to_query"):
        assert torch.equal(getattr(built, name), getattr(host, name)), name
    for v, keys in enumerate(host.seq_used.tolist()):
        assert torch.equal(built.slot_table[v, :keys], host.slot_table[v, :keys]), v
