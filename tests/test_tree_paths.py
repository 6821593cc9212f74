"""Tree rows as causal path requests (engine/tree_paths.py): every fixed row owned once,
and the path requests, run through a dense stand-in for FA3's paged varlen causal call
(pages of one slot, queries aligned to the end of their keys), give the tree attention
of the dense reference. tests/gpu runs the same tables through FA3 itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tree_attention_check import random_case

from vllm_dominotree.engine.tree_paths import (
    PathTables,
    attention_mode,
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
    ancestors, _, needs_fix = (a[0] for a in tree_bits(parents[None]))
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


def varlen_causal(query, key_slots, value_slots, tables: PathTables, scale):
    """What FA3's paged varlen causal call computes for the path requests (dense, float32):
    request v's keys are slot_table[v, :seq_used[v]], its queries the rows query_rows[
    query_start[v]:query_start[v + 1]], query i aligned to key seq_used - queries + i."""
    group = query.shape[1] // key_slots.shape[2]
    out = torch.zeros(tables.num_queries, *query.shape[1:])
    for v in range(tables.seq_used.numel()):
        first, end = int(tables.query_start[v]), int(tables.query_start[v + 1])
        keys = int(tables.seq_used[v])
        if first == end:
            continue
        slots = tables.slot_table[v, :keys].long()
        k = key_slots[slots, 0].float().repeat_interleave(group, dim=1)  # [keys, H, D]
        val = value_slots[slots, 0].float().repeat_interleave(group, dim=1)
        q = query[tables.query_rows[first:end]].float()
        scores = torch.einsum("nhd,khd->nhk", q, k) * scale
        last_key = keys - (end - first) + torch.arange(end - first)
        visible = torch.arange(keys)[None, :] <= last_key[:, None]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        out[first:end] = torch.einsum("nhk,khd->nhd", scores.softmax(-1), val)
    return out


@pytest.mark.parametrize("each_row", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_path_requests_give_the_tree_attention(seed, each_row):
    case = random_case("cpu", torch.float32, seed, requests=5, max_context=90)
    query, key_cache, value_cache, block_table, query_start, seq_lens, ancestors, needs_fix = case
    page = key_cache.shape[1]
    specs = batch_path_specs(query_start, seq_lens, ancestors, needs_fix, each_row)
    slot_mapping = batch_slot_mapping(block_table, query_start, seq_lens, page)
    assert specs, "the case has no branching tree"
    tables = PathTables(max_paths=64, max_tokens=query.shape[0], max_len=2048, device="cpu")
    tables.publish(specs, block_table, page, slot_mapping)
    scale = query.shape[-1] ** -0.5
    got = torch.full_like(query, 7.0)
    rows = varlen_causal(query, slot_view(key_cache), slot_view(value_cache), tables, scale)
    owned = tables.row_owned[: query.shape[0]]
    got[owned] = rows[tables.row_to_query[: query.shape[0]][owned]]
    want = torch.full_like(query, 7.0)
    tree_attention_reference(*case, scale, want)
    assert torch.equal(owned, needs_fix.bool())
    assert (got - want).abs().max() < 1e-5
    # The next step without paths leaves every request empty.
    tables.publish([], block_table, page, slot_mapping)
    assert not tables.row_owned.any() and not tables.seq_used.any()


def test_a_layout_without_a_uniform_slot_stride_is_refused():
    # vLLM's [blocks, page, kv heads, 2 D] split into K and V: block stride = page slots.
    keys = torch.zeros(4, 8, 2, 32)[..., :16]
    assert slot_view(keys).shape == (32, 1, 2, 16)
    assert slot_view(keys).data_ptr() == keys.data_ptr()
    heads_first = torch.zeros(4, 2, 8, 16).transpose(1, 2)  # [blocks, page, heads, D] view
    with pytest.raises(NotImplementedError, match="one-slot page view"):
        slot_view(heads_first)


def test_the_attention_mode_is_checked(monkeypatch):
    assert attention_mode() == "fixup"
    monkeypatch.setenv("DOMINOTREE_CUDA_TREE_ATTENTION", "paths")
    assert attention_mode() == "paths"
    monkeypatch.setenv("DOMINOTREE_CUDA_TREE_ATTENTION", "fa3")
    with pytest.raises(ValueError, match="DOMINOTREE_CUDA_TREE_ATTENTION='fa3'; use one of"):
        attention_mode()
