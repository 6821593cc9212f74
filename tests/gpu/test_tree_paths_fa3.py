"""Tree rows through FA3 over path requests (DOMINOTREE_CUDA_TREE_ATTENTION=paths): the
tables of engine/tree_paths.py, read by FA3 through the one-slot page view, give the
dense reference's tree attention and write only the rows that need a fix; how often
their elements differ from FA3's one-token decoding of each row's own path is printed
(the question benchmarks/tree_rounding_bench.py and the bf16 divergence test answer)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from tree_attention_check import (
    built_path_tables,
    path_build_inputs,
    path_tables,
    paths_output,
    random_case,
)

from vllm_dominotree.kernels.tree_attention import tree_attention_reference


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("shape", [(32, 8, 128), (9, 3, 64)])  # Qwen3-4B's, SmolLM2's
def test_paths_match_dense_reference_and_decoding(seed, shape):
    heads, kv_heads, head_dim = shape
    args = random_case(
        "cuda", torch.bfloat16, seed, heads=heads, kv_heads=kv_heads, head_dim=head_dim
    )
    fixed = args[-1].bool()
    assert fixed.any()
    got = paths_output(args, each_row=False)
    want = torch.zeros(args[0].shape, device="cuda")
    tree_attention_reference(args[0].float(), *args[1:], head_dim**-0.5, want)
    assert (got[fixed].float() - want[fixed]).abs().max() < 3e-2
    assert (got[~fixed] == 7.0).all()  # only the fixed rows are written
    decode = paths_output(args, each_row=True)
    differ = (got[fixed] != decode[fixed]).float().mean().item()
    print(f"seed {seed} shape {shape}: {100 * differ:.3f}% of elements differ from decoding")


@pytest.mark.parametrize("seed", range(3))
def test_paths_right_when_max_seqlen_k_is_below_the_true_lengths(seed):
    """The runner calls FA3 for the paths as vLLM calls it for the stock pass, with the
    step's longest sequence as max_seqlen_k; a FULL graph keeps the value of its capture
    (vLLM captures with sequences as short as the query), and replays with prefixes of
    any length. FA3 must then still read each request's true key count (seqused_k)."""
    args = random_case("cuda", torch.bfloat16, seed, heads=32, kv_heads=8, head_dim=128)
    fixed = args[-1].bool()
    assert int(args[5].max()) > 4 * 17  # prefixes far longer than the captured bound
    got = paths_output(args, each_row=False, max_seqlen_k=17)
    want = torch.zeros(args[0].shape, device="cuda")
    tree_attention_reference(args[0].float(), *args[1:], 128**-0.5, want)
    assert (got[fixed].float() - want[fixed]).abs().max() < 3e-2
    assert (got[~fixed] == 7.0).all()


@pytest.mark.parametrize("seed", range(3))
def test_one_pass_rows_in_place_match_the_reference(seed):
    """One pass (every_row): the trees in preorder own the forward's rows in order, so
    FA3 reads the queries and writes every row in place (no gathers): every row equals
    the dense reference within bf16 rounding (how many of the fixed rows' elements
    differ from the gathering call's, the fixed rows' own path requests, is printed)."""
    args = random_case("cuda", torch.bfloat16, seed, heads=32, kv_heads=8, head_dim=128)
    got = paths_output(args, each_row=False, every_row=True)
    every = torch.ones_like(args[-1])
    want = torch.zeros(args[0].shape, device="cuda")
    tree_attention_reference(args[0].float(), *args[1:-1], every, 128**-0.5, want)
    assert (got.float() - want).abs().max() < 3e-2
    fixed = args[-1].bool()
    gathered = paths_output(args, each_row=False)
    differ = (got[fixed] != gathered[fixed]).float().mean().item()
    print(f"seed {seed}: {100 * differ:.3f}% of the fixed rows' elements differ")


@pytest.mark.parametrize("shape", [(32, 8, 128), (64, 8, 128)])  # groups of 4 and 8
def test_paths_longer_than_fa3s_one_warpgroup_tile_keep_every_row(shape, monkeypatch):
    """FA3 is told at most 64 / group rows a path request (path_query_bound) so that it
    takes its one-warpgroup kernel of 64-row tiles; a chain of 17 rows packs 68 (136)
    query rows, two (three) such tiles, which FA3's prepared scheduler counts from
    cu_seqlens_q. Every row equals the dense reference; unsplit, bit for bit the rows of
    the two-warpgroup kernel that FA3 takes when told the tree's 17 rows. Split (vLLM's
    bound of 32), they may differ: FA3 sizes each request's split from the step's row
    tiles x key blocks, which the chains' second tiles raise (H100, 2026-12-06d)."""
    from vllm_dominotree.engine import cuda_attention

    heads, kv_heads, head_dim = shape
    group = heads // kv_heads
    assert cuda_attention.path_query_bound(17, heads, kv_heads, 3) * group <= 64
    args = random_case(
        "cuda", torch.bfloat16, 3, heads=heads, kv_heads=kv_heads, head_dim=head_dim, chains=True
    )
    every = torch.ones_like(args[-1])
    want = torch.zeros(args[0].shape, device="cuda")
    tree_attention_reference(args[0].float(), *args[1:-1], every, head_dim**-0.5, want)
    for splits in (1, 0, 32):
        one_warpgroup = paths_output(args, False, num_splits=splits, every_row=True)
        assert (one_warpgroup.float() - want).abs().max() < 3e-2, splits
        with monkeypatch.context() as patched:
            patched.setattr(cuda_attention, "FA3_ONE_WARPGROUP_ROWS", 17 * group)
            two_warpgroups = paths_output(args, False, num_splits=splits, every_row=True)
        differ = (one_warpgroup != two_warpgroups).float().mean().item()
        print(f"{shape} splits {splits}: {100 * differ:.3f}% of elements differ")
        assert splits != 1 or differ == 0


def test_a_mixed_steps_prefill_rows_cost_fa3_no_split_partials():
    """A mixed step outside any graph: 8000 prefill rows after the trees, 2k-token
    prefixes, FA3's own split count (vLLM's num_splits 0 there). FA3 keeps float32
    partials per query and split, and its heuristic, which assumes one long sequence in
    a varlen batch, splits 2k keys ~16 ways: handed every row of the step it asked 3.47
    GiB in an engine (H100, 2026-12-06d). The path pass hands it the trees' rows alone:
    its peak memory stays under 256 MiB (the write-back's gather of every row, 66 MB
    here, included; every row as FA3's queries would take ~2 GiB of partials), the
    fixed rows match the dense reference, the prefill rows are left alone."""
    from vllm_dominotree.engine.cuda_attention import attend_paths

    args = random_case(
        "cuda", torch.bfloat16, 1, heads=32, kv_heads=8, head_dim=128, contexts=[2048] * 4
    )
    query, key_cache, value_cache = args[:3]
    tokens, prefill = query.shape[0], 8000
    mixed = torch.cat([query, torch.randn(prefill, *query.shape[1:], device="cuda").to(query)])
    tables = path_tables(args, each_row=False, max_tokens=tokens + prefill)
    got = torch.full_like(mixed, 7.0)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    attend_paths(mixed, key_cache, value_cache, tables, 128**-0.5, 17, 2048 + 17, got)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < 256 * 2**20
    want = torch.zeros(query.shape, device="cuda")
    tree_attention_reference(query.float(), *args[1:], 128**-0.5, want)
    fixed = args[-1].bool()
    assert (got[:tokens][fixed].float() - want[fixed]).abs().max() < 3e-2
    assert (got[:tokens][~fixed] == 7.0).all() and (got[tokens:] == 7.0).all()


@pytest.mark.parametrize("seed", range(3))
def test_tables_built_on_the_gpu_wait_for_nothing_and_give_the_hosts_rows(seed):
    """The runner builds each step's path requests on the device (PathTables.build) so
    that asynchronous scheduling stays on: no wait for the GPU (CUDA's sync check), and
    FA3 through them gives the host-built tables' rows bit for bit."""
    args = random_case("cuda", torch.bfloat16, seed, heads=9, kv_heads=3, head_dim=64)
    tables = built_path_tables(args)  # first build: allocations, kernel loads unchecked
    inputs = path_build_inputs(args, tables.max_len)  # what the host knows of the step
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tables.build(**inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(paths_output(args, False, tables=tables), paths_output(args, False))


@pytest.mark.parametrize("every_row", [False, True])
def test_one_schedule_serves_every_layer_bit_for_bit(every_row):
    """The runner computes the path requests' FA3 schedule in a forward's first layer
    and hands it to every layer's call (PathTables.schedule_of): FA3 given it writes the
    rows it writes without one, bit for bit, call after call (its tile semaphore left as
    the next call needs it), with its own split heuristic and vLLM's bound of FULL
    graphs."""
    from vllm_dominotree.engine.cuda_attention import attend_paths, schedule_paths

    args = random_case("cuda", torch.bfloat16, 5, heads=32, kv_heads=8, head_dim=128)
    query, key_cache, value_cache = args[:3]
    tables = path_tables(args, each_row=False, every_row=every_row)
    longest = int(args[5].max())
    for splits in (0, 32):
        want = paths_output(args, False, tables=tables, num_splits=splits, every_row=every_row)
        shape = (query.shape[0], query.shape[1], key_cache)
        schedule = schedule_paths(tables, *shape, 17, longest, splits)
        for layer in range(3):
            got = torch.full_like(query, 7.0)
            attend_paths(query, key_cache, value_cache, tables, 128**-0.5, 17, longest, got,
                         num_splits=splits, every_row=every_row, schedule=schedule)  # fmt: skip
            assert torch.equal(got, want), (splits, layer)
