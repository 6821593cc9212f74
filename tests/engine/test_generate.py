"""LLM.generate with "method": "dominotree": lossless, really speculative, truthful metrics."""

from __future__ import annotations

import itertools
import os

import pytest

from vllm_dominotree import openmp
from vllm_dominotree.metrics import COUNTERS
from vllm_dominotree.openmp import engine_runtime

from .conftest import (
    PROMPTS,
    assert_sampled_law,
    dominotree,
    greedy,
    make_llm,
    shutdown,
    spec_metrics,
    tree_stats,
)


@pytest.fixture(scope="module")
def expected(baseline):
    return greedy(baseline)


@pytest.fixture(scope="module", params=["marginal", "chain"])
def other_scorer(request, pair_dirs):
    llm = make_llm(pair_dirs, dominotree(pair_dirs, scorer=request.param))
    yield request.param, llm
    shutdown(llm)


def test_conditional_greedy_equals_the_target_alone(conditional, expected):
    before = tree_stats(conditional)
    assert greedy(conditional) == expected
    after = tree_stats(conditional)
    trees = after["trees"] - before["trees"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    assert trees > 0
    # Drafts that are often right: well above one token per verification.
    assert 1 + accepted / trees > 2.5
    # A tree that quietly degraded to a chain would never accept a non-first child, and
    # would have one leaf.
    assert after["sibling_accepts"] > before["sibling_accepts"]
    assert after["kv_moves"] > before["kv_moves"]
    assert (after["tree_leaves"] - before["tree_leaves"]) / trees > 2.0


def test_stage_profile_splits_the_step(conditional, expected):
    """With the stage clock on, a step's time splits into verify, accept, draft and
    build (each measured, each inside the step), and the output does not change."""
    conditional.collective_rpc("dominotree_profile", args=(True,))
    try:
        assert greedy(conditional, max_tokens=24) == [e[:24] for e in expected]
        seconds = tree_stats(conditional)["stage_seconds"]
    finally:
        conditional.collective_rpc("dominotree_profile", args=(False,))
    parts = ("prepare", "verify", "accept", "draft", "build")
    assert all(seconds[name] > 0 for name in (*parts, "step")), seconds
    assert sum(seconds[name] for name in parts) < seconds["step"]
    assert tree_stats(conditional)["stage_seconds"] == {}  # off again, and reset


def test_trace_gives_the_hosts_time_per_stage(conditional, expected):
    """While tracing, the stages are profiler ranges: the host's milliseconds inside
    each come back with the trace, inside the step's, and tracing changes no output."""
    conditional.collective_rpc("dominotree_trace", args=(True,))
    try:
        assert greedy(conditional, max_tokens=24) == [e[:24] for e in expected]
    finally:
        trace = conditional.collective_rpc("dominotree_trace", args=(False,))[0]
    host = trace["host_ms"]
    parts = ("prepare", "verify", "accept", "draft", "build")
    assert trace["steps"] > 0
    assert all(host[name] > 0 for name in (*parts, "step")), host
    assert sum(host[name] for name in parts) < host["step"]
    # The torch ops of every stage are counted in it (CPU: no CUDA launches to count).
    ops = {stage: counts["torch_ops"] for stage, counts in trace["launches_by_stage"].items()}
    assert all(ops.get(name, 0) > 0 for name in (*parts, "step")), ops


def test_other_scorers_are_lossless(other_scorer, expected):
    scorer, llm = other_scorer
    assert greedy(llm) == expected
    stats = tree_stats(llm)
    assert stats["trees"] > 0 and stats["mean_accept_length"] > 1.5
    assert stats["tree_attention"] == "cpu"  # path requests (cpu_attention.py)
    # CPU: no captured builds; every step's trees were built (at least one per tree step).
    assert stats["graph_builds"] == 0 and stats["eager_builds"] >= stats["steps"] > 0
    assert stats["graph_accepts"] == 0 and stats["eager_accepts"] >= stats["steps"]
    assert stats["graph_descriptions"] == 0 and stats["eager_descriptions"] == stats["steps"]
    if scorer == "chain":
        assert stats["sibling_accepts"] == 0 and stats["kv_moves"] == 0
        assert stats["mean_leaves"] == 1.0
        assert stats["one_pass_steps"] == 0  # nothing to fix: vLLM's causal pass alone
    else:  # a tree that quietly became a chain would show here
        assert stats["mean_leaves"] > 2.0, stats
        # Steps of branching trees alone skip vLLM's pass, their path requests computing
        # every row (cpu_attention.py): the engine says how many.
        assert 0 < stats["one_pass_steps"] <= stats["steps"], stats


@pytest.mark.parametrize("scorer", ["conditional", "chain"])
def test_budget_below_the_drafters_block_on_cpu(pair_dirs, expected, scorer):
    """A budget under the drafter's block (8 here): vLLM still reserves the block's slots
    for the drafter, the scheduler verifies 1 + budget rows per request, and the output
    is the target's own; the chain is then a path of `budget` drafts."""
    llm = make_llm(pair_dirs, dominotree(pair_dirs, budget=3, scorer=scorer))
    try:
        assert greedy(llm) == expected
        metrics = spec_metrics(llm)
        stats = tree_stats(llm)
    finally:
        shutdown(llm)
    assert stats["budget"] == 3  # the report names it (round_cost_bench's `-bN` check)
    assert stats["openmp"] == "libgomp"  # vLLM's default (openmp.py)
    assert stats["trees"] > 0 and stats["tree_nodes"] == 3 * stats["trees"]
    assert (
        metrics["vllm:spec_decode_num_draft_tokens"] == 3 * metrics["vllm:spec_decode_num_drafts"]
    )
    assert stats["mean_accept_length"] > 1.5, stats
    assert stats["mean_leaves"] == 1.0 if scorer == "chain" else stats["mean_leaves"] > 1.0


def greedy_and_stats(pair_dirs, **options) -> tuple[list, dict]:
    """A DominoTree engine of these options: its greedy outputs and its tree stats."""
    llm = make_llm(pair_dirs, dominotree(pair_dirs, **options))
    try:
        return greedy(llm), tree_stats(llm)
    finally:
        shutdown(llm)


def test_max_leaves_bounds_every_trees_leaves(pair_dirs, expected):
    """`max_leaves`: the engine's trees have at most that many leaves (the toy pair's
    trees average more than 2 without it, test_other_scorers_are_lossless), still
    branch, and the output is the target's own."""
    outputs, stats = greedy_and_stats(pair_dirs, max_leaves=2)
    assert outputs == expected
    assert stats["trees"] > 0 and stats["mean_accept_length"] > 1.5, stats
    assert stats["max_leaves"] == 2 and 1.0 < stats["mean_leaves"] <= 2.0, stats
    assert stats["tree_leaves"] <= 2 * stats["trees"], stats


def test_step_leaves_of_one_make_every_tree_a_path(pair_dirs, expected):
    """`step_leaves`: a step's trees share that many leaves (at least one each), so with
    one every tree of every step is a single path, whatever the batch; the engine says
    so and the output is the target's own."""
    outputs, stats = greedy_and_stats(pair_dirs, step_leaves=1)
    assert outputs == expected
    assert stats["trees"] > 0 and stats["step_leaves"] == 1, stats
    assert stats["tree_leaves"] == stats["trees"], stats


def test_step_nodes_verify_fewer_rows_in_larger_batches(pair_dirs, expected):
    """`step_nodes`: a step's trees share that many nodes (at least one each), so the
    eight prompts' steps (8 padded rows) get trees of one node, and as requests finish,
    steps of fewer rows get more (4 rows: 2 nodes, 2 rows: 4, the budget); vLLM then
    schedules that many drafts, so the rows verified fall with the batch; the output is
    the target's own."""
    llm = make_llm(pair_dirs, dominotree(pair_dirs, budget=4, step_nodes=8))
    try:
        assert greedy(llm) == expected
        metrics = spec_metrics(llm)
        stats = tree_stats(llm)
        # Alone, a request's tree has the whole budget of 4.
        greedy(llm, prompts=PROMPTS[:1])
        alone = tree_stats(llm)
    finally:
        shutdown(llm)
    assert stats["step_nodes"] == 8 and stats["budget"] == 4, stats
    assert stats["trees"] > 0 and stats["mean_accept_length"] > 1.2, stats
    # Fewer nodes than budgets on the whole, and a verification of each node, no more.
    assert stats["trees"] <= stats["tree_nodes"] < 4 * stats["trees"], stats
    assert metrics["vllm:spec_decode_num_draft_tokens"] == stats["tree_nodes"], metrics
    trees, nodes = alone["trees"] - stats["trees"], alone["tree_nodes"] - stats["tree_nodes"]
    assert trees > 0 and nodes == 4 * trees, (stats, alone)


def test_the_engine_runs_on_the_openmp_runtime_the_entry_points_preload(
    pair_dirs, expected, monkeypatch
):
    """vLLM preloads GNU OpenMP into a CPU engine's processes unless LD_PRELOAD names a
    runtime; the main command and the harness start speculative engines on Intel's
    (openmp.py), and the worker's report says what it runs on."""
    monkeypatch.setenv("LD_PRELOAD", os.environ.get("LD_PRELOAD", ""))  # restored after
    monkeypatch.setattr(openmp, "STARTED_WITH", "")
    assert engine_runtime(speculative=True).startswith("Intel OpenMP")
    outputs, stats = greedy_and_stats(pair_dirs, budget=3)
    assert outputs == expected
    assert stats["openmp"] == "libiomp"


def test_vllm_metrics_agree_with_the_runner(pair_dirs):
    """vLLM's spec-decode counters (drafts, draft tokens, accepted, per position) and the
    plugin's own figures in LLM.get_metrics() (metrics.py) must tell the same story as
    the runner's own accounting."""
    llm = make_llm(pair_dirs, dominotree(pair_dirs, budget=12))
    try:
        greedy(llm)
        metrics = spec_metrics(llm)
        ours = {m.name: m for m in llm.get_metrics() if m.name.startswith("dominotree_")}
        stats = tree_stats(llm)
    finally:
        shutdown(llm)
    for name in COUNTERS:
        assert ours[f"dominotree_{name}"].value == stats[name], name
    assert stats["trees"] > 0 and stats["sibling_accepts"] > 0
    assert stats["tree_nodes"] == 12 * stats["trees"]  # every tree padded to the budget
    builds = stats["graph_builds"] + stats["eager_builds"]
    for name in ("dominotree_draft_seconds", "dominotree_build_seconds"):
        assert ours[name].count == builds >= stats["steps"], name  # one per drafting step
        assert ours[name].sum > 0 and ours[name].buckets["+Inf"] == builds
    assert metrics["vllm:spec_decode_num_accepted_tokens"] == stats["accepted_tokens"]
    assert metrics["vllm:spec_decode_num_drafts"] >= stats["trees"]
    assert (
        metrics["vllm:spec_decode_num_draft_tokens"] == 12 * metrics["vllm:spec_decode_num_drafts"]
    )
    per_position = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert sum(per_position) == stats["accepted_tokens"]
    assert all(a >= b for a, b in itertools.pairwise(per_position))


def test_sampled_tokens_follow_the_target_distribution(conditional, pair_dirs):
    assert_sampled_law(conditional, pair_dirs["target"])


def test_seeds_reproduce(conditional):
    from vllm import SamplingParams

    def run(seed):
        params = SamplingParams(temperature=1.0, max_tokens=30, seed=seed, ignore_eos=True)
        return list(
            conditional.generate([{"prompt_token_ids": PROMPTS[2]}], params, use_tqdm=False)[0]
            .outputs[0]
            .token_ids
        )

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_plain_dflash_chain_matches_vllm_dflash(pair_dirs, expected):
    """A plain DFlash checkpoint through the plugin's chain scorer drafts exactly what
    vLLM's own "dflash" method drafts: same outputs and the same acceptance, position by
    position."""
    results = {}
    configs = {
        "plugin": {"method": "dominotree", "model": pair_dirs["dflash"], "scorer": "chain"},
        "vllm": {"method": "dflash", "model": pair_dirs["dflash"], "num_speculative_tokens": 7},
    }
    for name, config in configs.items():
        llm = make_llm(pair_dirs, config)
        try:
            results[name] = (greedy(llm), spec_metrics(llm))
        finally:
            shutdown(llm)
    assert results["plugin"][0] == results["vllm"][0] == expected
    ours, theirs = results["plugin"][1], results["vllm"][1]
    for key in (
        "vllm:spec_decode_num_drafts",
        "vllm:spec_decode_num_accepted_tokens",
        "vllm:spec_decode_num_accepted_tokens_per_pos",
    ):
        assert ours[key] == theirs[key], key
    assert ours["vllm:spec_decode_num_accepted_tokens"] > 0
