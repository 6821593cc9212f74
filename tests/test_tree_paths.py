"""Tree rows as causal path requests (engine/tree_paths.py): every fixed row owned once,
and the path requests, run through a dense stand-in for FA3's paged varlen causal call
(pages of one slot, queries aligned to the end of their keys), give the tree attention
of the dense reference. tests/gpu runs the same tables through FA3 itself."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from interpreter import run_interpreted
from path_checks import attend_case, fa3_stand_in, publish_case, reference
from tree_attention_check import random_case

from vllm_dominotree.config import attention_mode, path_splits
from vllm_dominotree.engine import tree_attention_setup
from vllm_dominotree.engine.cuda_attention import attend_paths, path_query_bound, schedule_paths
from vllm_dominotree.engine.tree_paths import PathTables, slot_view, split_into_paths
from vllm_dominotree.tree.ancestry import in_preorder, tree_bits


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


@pytest.mark.parametrize("seed", range(40))
def test_every_row_is_owned_once_in_one_pass(seed):
    """One pass: every row, the root included (with the first path), in path order."""
    rng = np.random.default_rng(seed)
    parents = random_tree(rng, int(rng.integers(1, 18)))
    ancestors, _, needs_fix = (a[0].numpy() for a in tree_bits(torch.from_numpy(parents[None])))
    paths = split_into_paths(ancestors, needs_fix, every_row=True)
    owned = [row for path, k in paths for row in [0, *path][len(path) + 1 - k :]]
    assert sorted(owned) == list(range(len(parents)))
    assert paths[0][1] == len(paths[0][0]) + 1  # the first path owns the root and all its rows
    assert len(paths) == max(1, sum(i not in parents for i in range(1, len(parents))))


@pytest.mark.parametrize("seed", range(40))
def test_one_pass_queries_are_the_rows_in_order_for_trees_in_preorder(seed):
    """A step's trees come in depth-first preorder (tree/ancestry.in_preorder): then one
    pass's path requests own the rows in the forward's order, which lets attend_paths
    skip its gathers; in pop order they need not (root -> 1 -> 3 beside root -> 2)."""
    rng = np.random.default_rng(seed)
    parents = torch.from_numpy(random_tree(rng, int(rng.integers(1, 18)))[None])
    parents = in_preorder(parents, parents, parents)[1]
    ancestors, _, needs_fix = (a[0].numpy() for a in tree_bits(parents))
    paths = split_into_paths(ancestors, needs_fix, every_row=True)
    owned = [row for path, k in paths for row in [0, *path][len(path) + 1 - k :]]
    assert owned == list(range(parents.shape[1]))
    pop_order = np.array([-1, 0, 0, 1])
    ancestors, _, needs_fix = (a[0].numpy() for a in tree_bits(torch.from_numpy(pop_order[None])))
    paths = split_into_paths(ancestors, needs_fix, every_row=True)
    assert [row for path, k in paths for row in [0, *path][len(path) + 1 - k :]] == [0, 2, 1, 3]


@pytest.mark.parametrize("seed", range(6))
def test_one_pass_tables_give_every_rows_attention(seed):
    case = random_case("cpu", torch.float32, seed, requests=5, max_context=90)
    tables = PathTables(max_paths=64, max_tokens=case[0].shape[0], max_len=2048, device="cpu")
    publish_case(tables, case, every_row=True)
    assert tables.row_owned[: case[0].shape[0]].all()
    want = reference(case, every_row=True)
    for every_row in (False, True):  # the gather-and-where and one pass's single gather
        assert (attend_case(tables, case, every_row) - want).abs().max() < 1e-5


def test_one_pass_skips_the_stock_pass_only_for_steps_of_trees_alone(monkeypatch):
    import vllm.forward_context
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    from vllm_dominotree.engine.cuda_attention import stock_pass_skipped
    from vllm_dominotree.engine.tree_step import TreeVerification

    one = TreeVerification(None, frozenset(), 17, one_pass=True)
    two = TreeVerification(None, frozenset(), 17)
    metadata = SimpleNamespace(max_query_len=17, seq_lens=torch.zeros(2, dtype=torch.int32))
    assert not stock_pass_skipped(one, metadata, 34)  # eager: no step prepared yet
    one.every_row = two.every_row = True
    assert stock_pass_skipped(one, metadata, 34) and not stock_pass_skipped(two, metadata, 34)
    one.every_row = False  # a step with a request that is not a tree
    assert not stock_pass_skipped(one, metadata, 34)
    # Capture, V1 (a FULL forward context): FULL graphs of uniform batches (replayed for
    # all-tree steps only) record no stock pass; piecewise captures and FULL graphs of
    # mixed batches (vLLM's pure FULL mode) keep it.
    one.capturing = two.capturing = True
    for mode, uniform, alone in [
        (CUDAGraphMode.FULL, True, True),
        (CUDAGraphMode.FULL, False, False),
        (CUDAGraphMode.PIECEWISE, True, False),
    ]:
        batch = BatchDescriptor(num_tokens=34, num_reqs=2, uniform=uniform)
        context = SimpleNamespace(cudagraph_runtime_mode=mode, batch_descriptor=batch)
        monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda c=context: c)
        assert stock_pass_skipped(one, metadata, 34) == alone
        assert not stock_pass_skipped(two, metadata, 34)
    # Capture, V2 (mode NONE, no batch descriptor, the stream capturing): its uniform
    # decode graphs of 1 + budget rows per request record no stock pass; its warm-up runs
    # (not capturing), a mixed FULL graph's shape (max_query_len = its tokens) and a
    # uniform graph of another row count keep it.
    context = SimpleNamespace(cudagraph_runtime_mode=CUDAGraphMode.NONE, batch_descriptor=None)
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: context)
    for capturing, max_query_len, num_tokens, alone in [
        (True, 17, 34, True),
        (False, 17, 34, False),
        (True, 34, 34, False),
        (True, 8, 16, False),
    ]:
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda c=capturing: c)
        metadata.max_query_len = max_query_len
        assert stock_pass_skipped(one, metadata, num_tokens) == alone
        assert not stock_pass_skipped(two, metadata, num_tokens)


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


def test_a_mixed_steps_prefill_rows_are_not_fa3s_queries():
    """Outside a graph FA3 keeps float32 partials for each of its queries per split, and
    a mixed step holds thousands of prefill rows beside the trees (on an H100 a batch of
    16 requests of 2048-token prompts asked for 3.47 GiB): FA3 gets the trees' rows at
    most (the tables' host bound), and the rows after them are left alone."""
    case = random_case("cpu", torch.float32, 4, requests=5, max_context=90)
    tokens = case[0].shape[0]
    tables = PathTables(max_paths=64, max_tokens=tokens + 600, max_len=2048, device="cpu")
    publish_case(tables, case)
    assert 0 < tables.query_bound == int(case[-1].sum()) < tokens
    prefill = torch.randn(600, *case[0].shape[1:])
    mixed = (torch.cat([case[0], prefill]), *case[1:])
    called = {}

    def varlen(**kwargs):
        called.update(kwargs)
        return fa3_stand_in(**kwargs)

    got = torch.full_like(mixed[0], 7.0)
    attend_paths(*mixed[:3], tables, 64**-0.5, 17, int(case[5].max()), got, varlen=varlen)
    assert called["q"].shape[0] == tables.query_bound
    assert (got[:tokens] - reference(case)).abs().max() < 1e-5
    assert (got[tokens:] == 7.0).all()


def test_a_forward_without_trees_leaves_every_row_alone():
    """Cleared tables (a forward without trees, as vLLM's memory profiling run) own no
    row: outside a graph FA3 is not called and the stock pass's rows stay (an empty
    query set made the gather index past FA3's empty output, and tree engines failed to
    start: H100, 2026-12-06f)."""
    case = random_case("cpu", torch.float32, 1, requests=3, max_context=60)
    tables = PathTables(max_paths=64, max_tokens=case[0].shape[0], max_len=2048, device="cpu")
    publish_case(tables, case)
    tables.clear()
    called = []
    got = torch.full_like(case[0], 7.0)
    attend_paths(*case[:3], tables, 1.0, 17, int(case[5].max()), got,
                 varlen=lambda **kwargs: called.append(kwargs))  # fmt: skip
    assert not called
    assert (got == 7.0).all()


def test_the_schedule_is_computed_for_the_call_it_steers():
    """schedule_paths asks FA3's scheduler about the very call attend_paths makes (batch,
    key counts, query starts, bounds, split count, heads, one-slot pages): FA3 trusts a
    given schedule, so a schedule of another call would misplace its tiles."""
    case = random_case("cpu", torch.float32, 2, requests=5, max_context=90)
    query, key_cache, value_cache = case[:3]
    tables = PathTables(max_paths=64, max_tokens=query.shape[0], max_len=2048, device="cpu")
    publish_case(tables, case, every_row=True)
    asked, called = {}, {}

    def scheduler(**kwargs):
        asked.update(kwargs)
        return torch.tensor([7], dtype=torch.int32)

    def varlen(**kwargs):
        called.update(kwargs)
        return fa3_stand_in(**kwargs)

    longest, splits = int(case[5].max()), 3
    args = (tables, query.shape[0], query.shape[1], key_cache, 17, longest, splits)
    schedule = schedule_paths(*args, scheduler=scheduler)
    out = torch.full_like(query, 7.0)
    attend_paths(query, key_cache, value_cache, tables, 1.0, 17, longest, out,
                 num_splits=splits, varlen=varlen, every_row=True, schedule=schedule)  # fmt: skip
    assert called["scheduler_metadata"] is schedule
    assert asked["batch_size"] == called["cu_seqlens_q"].numel() - 1
    assert torch.equal(asked["cache_seqlens"], called["seqused_k"])
    assert torch.equal(asked["cu_seqlens_q"], called["cu_seqlens_q"])
    for theirs, ours in [("max_seqlen_q", "max_seqlen_q"), ("max_seqlen_k", "max_seqlen_k"),
                         ("num_splits", "num_splits"), ("causal", "causal")]:  # fmt: skip
        assert asked[theirs] == called[ours], theirs
    q, k = called["q"], called["k"]
    # 17 rows told as 16 (a group of 4: FA3's one-warpgroup kernel, path_query_bound)
    assert (q.shape[1] // k.shape[2], called["max_seqlen_q"]) == (4, 16)
    assert (asked["num_heads_q"], asked["headdim"]) == (q.shape[1], q.shape[2])
    assert (asked["num_heads_kv"], asked["page_size"]) == (k.shape[2], k.shape[1])
    assert asked["qkv_dtype"] == k.dtype


def test_fa3_is_told_few_enough_rows_for_its_one_warpgroup_kernel():
    """FA3 takes 64-row query tiles when max_seqlen_q x group <= 64: the bound told for
    17-row trees by group (Qwen3's 4, SmolLM2's 3, 8, one beyond 64), and FA2 (whose
    grid counts max_seqlen_q's tiles) told the tree's rows."""
    bounds = [
        path_query_bound(17, heads, kv, 3) for heads, kv in [(32, 8), (9, 3), (64, 8), (128, 1)]
    ]
    assert bounds == [16, 17, 8, 1]
    assert path_query_bound(17, 32, 8, 2) == 17


def test_one_schedule_per_forward():
    """The first layer of a forward computes the path requests' schedule and the others
    reuse it; the next forward (a new attention metadata) computes its own, and so does
    a forward after the tables were filled again."""
    tables = PathTables(max_paths=4, max_tokens=4, max_len=8, device="cpu")
    computed = []

    def compute():
        computed.append(torch.zeros(1))
        return computed[-1]

    first, second = object(), object()
    got = [tables.schedule_of(first, compute) for _ in range(3)]
    assert len(computed) == 1 and all(g is computed[0] for g in got)
    assert tables.schedule_of(second, compute) is computed[1]
    assert tables.schedule_of(first, compute) is computed[2]  # not what `first` had
    tables.clear()  # tables filled anew: no forward keeps the old schedule
    assert tables.schedule_of(first, compute) is computed[3]
    assert tables.schedule_of(first, compute) is computed[3]


def test_a_layout_without_a_uniform_slot_stride_is_refused():
    # vLLM's [blocks, page, kv heads, 2 D] split into K and V: block stride = page slots.
    keys = torch.zeros(4, 8, 2, 32)[..., :16]
    assert slot_view(keys).shape == (32, 1, 2, 16)
    assert slot_view(keys).data_ptr() == keys.data_ptr()
    heads_first = torch.zeros(4, 2, 8, 16).transpose(1, 2)  # [blocks, page, heads, D] view
    with pytest.raises(NotImplementedError, match="one-slot page view"):
        slot_view(heads_first)


def test_the_attention_mode_is_checked(monkeypatch):
    assert attention_mode() == "auto"  # one pass where the target runs FA3, else fixup
    monkeypatch.setenv("DOMINOTREE_CUDA_TREE_ATTENTION", "fixup")
    assert attention_mode() == "fixup"
    monkeypatch.setenv("DOMINOTREE_CUDA_TREE_ATTENTION", "paths")
    assert attention_mode() == "paths"
    monkeypatch.setenv("DOMINOTREE_CUDA_TREE_ATTENTION", "one-pass")
    assert attention_mode() == "one-pass"
    monkeypatch.setenv("DOMINOTREE_CUDA_TREE_ATTENTION", "one-pass-fixup")
    assert attention_mode() == "one-pass-fixup"
    monkeypatch.setenv("DOMINOTREE_CUDA_TREE_ATTENTION", "fa3")
    with pytest.raises(ValueError, match="DOMINOTREE_CUDA_TREE_ATTENTION='fa3'; use one of"):
        attention_mode()


def test_each_runner_takes_the_tree_attention_it_has(monkeypatch):
    """One pass where the target runs FA3 (paths where FA3's call also writes the KV
    cache, or where the engine cannot take one pass: V2 under cudagraph_mode FULL), else
    fixup; an asked-for one pass such an engine cannot take is refused at startup, naming
    the variable, the reason and the choices."""
    from vllm.config import CUDAGraphMode

    from vllm_dominotree.engine.v2_runner import DominoTreeV2RunnerMixin

    def v2_reason(mode, adaptive=False):
        runner = SimpleNamespace(
            compilation_config=SimpleNamespace(cudagraph_mode=mode),
            speculator=SimpleNamespace(enable_adaptive_verification=adaptive),
        )
        return DominoTreeV2RunnerMixin._no_one_pass(runner)

    assert v2_reason(CUDAGraphMode.FULL_AND_PIECEWISE) is None  # vLLM's default
    assert v2_reason(CUDAGraphMode.NONE) is None
    assert "adaptive verification" in v2_reason(CUDAGraphMode.FULL_AND_PIECEWISE, True)
    reason = v2_reason(CUDAGraphMode.FULL)
    assert "FULL_AND_PIECEWISE" in reason
    choose = tree_attention_setup.cuda_tree_attention
    for kv_update, auto in ((False, "one-pass"), (True, "paths")):
        assert choose(fa3=True, kv_update_in_forward=kv_update, no_one_pass=None) == auto
        assert choose(fa3=True, kv_update_in_forward=kv_update, no_one_pass=reason) == "paths"
    for no_one_pass in (None, reason):
        assert choose(False, False, no_one_pass) == "fixup"
    monkeypatch.setenv("DOMINOTREE_CUDA_TREE_ATTENTION", "paths")
    assert choose(True, False, reason) == choose(True, False, None) == "paths"
    for mode in ("one-pass", "one-pass-fixup", "one-pass-merge"):
        monkeypatch.setenv("DOMINOTREE_CUDA_TREE_ATTENTION", mode)
        assert choose(True, False, None) == mode
        with pytest.raises(ValueError, match=f"{mode} is not available here: .*FULL_AND_PIECE"):
            choose(True, False, reason)


@pytest.mark.parametrize("mode", ["one-pass", "one-pass-merge"])
def test_merged_one_pass_steps_build_no_path_requests(monkeypatch, mode):
    """one-pass-merge: a step of trees alone reads its prefixes' lengths (allocated here)
    and no path requests; other steps still build them (the stock pass plus paths)."""
    from vllm_dominotree.engine.tree_step import TreeStepBuffers, TreeVerification

    monkeypatch.setenv("DOMINOTREE_CUDA_TREE_ATTENTION", mode)
    cpu = torch.device("cpu")
    verification = TreeVerification(TreeStepBuffers(64, cpu), frozenset(), 17)
    layer = SimpleNamespace(attn_backend=SimpleNamespace(forward_includes_kv_cache_update=False))
    chosen = tree_attention_setup.configure(
        verification, layer, no_one_pass=None, max_paths=32, max_tokens=64, max_len=256,
        device=cpu,
    )  # fmt: skip
    merge = mode == "one-pass-merge"
    assert chosen == mode and verification.one_pass and verification.merge == merge
    positions = torch.zeros(64, dtype=torch.int64)
    assert verification.paths is not None
    assert verification.begin_step(4, False, positions).builds_paths  # beside a prefill
    assert verification.begin_step(4, True, positions).builds_paths != merge
    assert (verification.prefix_lens is not None) == merge


def test_the_path_split_count_is_checked(monkeypatch):
    assert path_splits() is None  # as vLLM calls the stock pass
    monkeypatch.setenv("DOMINOTREE_PATH_SPLITS", "1")
    assert path_splits() == 1
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv("DOMINOTREE_PATH_SPLITS", bad)
        with pytest.raises(ValueError, match=f"DOMINOTREE_PATH_SPLITS='{bad}'; use"):
            path_splits()


BUILD_CHECKS = """
import path_checks as c
for seed in range(8):
    c.check_build_equals_publish(seed)
    c.check_build_equals_publish(seed, every_row=True)
c.check_build_equals_publish(8, requests=70, max_context=8)  # trees past one count block
c.check_build_after_a_larger_step()
for seed in range(6):
    c.check_runner_build(seed)
print("ok")
"""


def test_the_build_kernels_give_the_hosts_tables():
    """PathTables.build (kernels/path_build.py) under Triton's interpreter: the host's
    tables on random batches, from the runner's step descriptions, and over a larger
    step's tables."""
    run_interpreted(BUILD_CHECKS)
