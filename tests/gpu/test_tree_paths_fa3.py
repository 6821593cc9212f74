"""Tree rows through FA3 over path requests (DOMINOTREE_CUDA_TREE_ATTENTION=paths): the
tables of engine/tree_paths.py, read by FA3 through the one-slot page view, give the
dense reference's tree attention, write only the rows that need a fix, and round like
FA3's one-token decoding of each row's own path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from tree_attention_check import random_case

from vllm_dominotree.engine.cuda_attention import attend_paths
from vllm_dominotree.engine.tree_paths import PathTables, batch_path_specs, batch_slot_mapping
from vllm_dominotree.kernels.tree_attention import tree_attention_reference


def through_paths(args, each_row: bool) -> torch.Tensor:
    query, key_cache, value_cache, block_table, query_start, seq_lens, ancestors, needs_fix = args
    page = key_cache.shape[1]
    tables = PathTables(query.shape[0], query.shape[0], block_table.shape[1] * page, "cuda")
    tables.publish(
        batch_path_specs(query_start, seq_lens, ancestors, needs_fix, each_row),
        block_table,
        page,
        batch_slot_mapping(block_table, query_start, seq_lens, page),
    )
    out = torch.full_like(query, 7.0)
    attend_paths(query, key_cache, value_cache, tables, query.shape[-1] ** -0.5, 17, out)
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("shape", [(32, 8, 128), (9, 3, 64)])  # Qwen3-4B's, SmolLM2's
def test_paths_match_dense_reference_and_decoding(seed, shape):
    heads, kv_heads, head_dim = shape
    args = random_case(
        "cuda", torch.bfloat16, seed, heads=heads, kv_heads=kv_heads, head_dim=head_dim
    )
    fixed = args[-1].bool()
    assert fixed.any()
    got = through_paths(args, each_row=False)
    want = torch.zeros(args[0].shape, device="cuda")
    tree_attention_reference(args[0].float(), *args[1:], head_dim**-0.5, want)
    assert (got[fixed].float() - want[fixed]).abs().max() < 3e-2
    assert (got[~fixed] == 7.0).all()  # only the fixed rows are written
    decode = through_paths(args, each_row=True)
    differ = (got[fixed] != decode[fixed]).float().mean().item()
    print(f"seed {seed} shape {shape}: {100 * differ:.3f}% of elements differ from decoding")
