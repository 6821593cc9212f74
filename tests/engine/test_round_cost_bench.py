"""benchmarks/round_cost_bench.py end to end on its tiny shape (CPU): every method runs in
vLLM, the plugin's rounds are split into stages, and the projection uses the paper's
accept lengths. Timings are not checked (this is a run of the benchmark, not of a
machine); what is checked is that each number comes from what ran."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from round_cost_bench import (  # noqa: E402
    PAPER_TAU,
    SHAPES,
    STEP_COUNTS,
    check_one_table,
    check_variant_ran,
    gathered_rows,
    speculative_config,
    split_options,
    split_variants,
    tree_fields,
    trees_cell,
    verify_vs_dflash,
)

# A variant too: synchronous scheduling (the CPU's anyway), vLLM's drafter pass, the
# preparation apart from the build, and a draft vocabulary of half the tiny vocabulary.
METHODS = [
    "ar",
    "dflash",
    "chain",
    "marginal",
    "conditional",
    "conditional-sync-vllm-draft-prepare-apart-vocab256",
]
BATCHES = [1, 2]
TOKENS = 12
PROMPT_TOKENS = 40


def test_round_cost_bench_runs_every_method(tmp_path):
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "round_cost_bench.py"),
        "--out",
        str(tmp_path),
        "--shape",
        "tiny",
        "--batches",
        *map(str, BATCHES),
        "--tokens",
        str(TOKENS),
        "--prompt-tokens",
        str(PROMPT_TOKENS),
        "--repeats",
        "2",
        "--enforce-eager",
        "--methods",
        *METHODS,
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    rows = json.loads((tmp_path / "round_cost.json").read_text())["rows"]
    assert [(r["method"], r["batch"]) for r in rows] == [(m, b) for m in METHODS for b in BATCHES]
    for r in rows:
        base = split_variants(r["method"])[0]
        assert r["ms_per_round"] > 0 and r["prompt_tokens"] == PROMPT_TOKENS
        # As the engine was built: one GPU (or CPU process), the shape asked for.
        assert r["tensor_parallel_size"] == 1 and r["shape"] == "tiny"
        # One engine per method: its start is each of its rows' (seconds, not zero).
        assert r["engine_start_s"] > 1
        assert (
            r["engine_start_s"]
            == rows[[x["method"] for x in rows].index(r["method"])]["engine_start_s"]
        )
        # No graphs on CPU (enforce_eager): none captured, none widened.
        assert r["graph_tokens"] == 0
        # The median of the repeated runs of one batch.
        assert len(r["ms_per_round_runs"]) == 2
        assert r["ms_per_round"] == sum(r["ms_per_round_runs"]) / 2
        if r["method"] == "ar":
            assert r["rounds"] == TOKENS - 1 and r["accept_length"] == 1
        else:
            # Counted by vLLM: a round commits 1..block tokens, so rounds lie in between.
            assert (TOKENS - 1) / 16 <= r["rounds"] <= TOKENS - 1, r
        if base in ("chain", "marginal", "conditional"):
            assert r["async_scheduling"] is False and r["graph_drafts"] == 0  # CPU
            assert r["prepared_in_build"] == 0
            # a chain has one leaf; trees at least one (a tree may be a chain)
            assert r["mean_leaves"] == 1 if base == "chain" else r["mean_leaves"] >= 1, r
            # What the engine ran, as its stats name it: no variant passes unseen.
            # CPU: one pass where a step's trees branch (a chain never does).
            assert r["tree_attention"] == "cpu", r
            assert r["one_pass_share"] == 0 if base == "chain" else r["one_pass_share"] > 0, r
            assert r["scorer_step"] == ("table" if base == "marginal" else "torch"), r
            split = r["profiled_ms"]
            assert set(split) == {"prepare", "verify", "accept", "draft", "build", "rest"}
            assert all(split[k] > 0 for k in ("verify", "draft", "build")), split
            # The traced pass counted per step (zeros here: no CUDA on this machine).
            assert set(r["per_step"]) == {
                "graph_launches",
                "kernel_launches",
                "host_waits",
                "memcpy_async",
            }
            # and the host's ms per stage (profiler ranges), inside the step's.
            host = r["host_ms_per_step"]
            assert all(host[k] > 0 for k in ("prepare", "verify", "draft", "build", "step"))
            assert host["draft"] + host["build"] < host["step"], host
            # The GPU's kernel time: none on this machine.
            assert r["kernel_ms_per_round"] == 0 and r["kernel_ms_per_round_by_stage"] == {}
            assert r["top_kernels_per_round_by_stage"] == {}
        else:
            assert "profiled_ms" not in r
            # vLLM's own methods traced through the benchmark's worker extension, counted
            # per step as the plugin's are (zeros: no CUDA calls on this machine).
            assert r["kernel_ms_per_round"] == 0
            assert r["per_step"] == dict.fromkeys(STEP_COUNTS, 0)
            # Their runners labelled where the plugin's V2 runner names its stages: the
            # host's ms in each, the drafter's inside sample (where vLLM proposes).
            host = r["host_ms_per_round_by_stage"]
            stages = {"verify", "sample", "draft"} if base == "dflash" else {"verify", "sample"}
            assert set(host) == stages, host
            assert all(v > 0 for v in host.values()), host
            if base == "dflash":
                assert host["draft"] < host["sample"], host
        assert r["host_waits_by_scope"] == {}
        if base in PAPER_TAU:
            ar = next(a for a in rows if a["method"] == "ar" and a["batch"] == r["batch"])
            tau = PAPER_TAU[base][1]
            expected = tau * ar["ms_per_round"] / r["ms_per_round"]
            assert abs(r["projection"]["projected_speedup"] - expected) < 1e-9
    table = (tmp_path / "round_cost.md").read_text()
    assert table.startswith("# Round cost on CPU")
    assert f"prompts of {PROMPT_TOKENS} tokens" in table
    assert sum(line.startswith("| ") for line in table.splitlines()) == 1 + len(rows)
    assert "DominoTree (16)" in table


def test_method_variants_name_their_engine_arguments_and_environment():
    assert split_variants("conditional-paths-sync") == (
        "conditional",
        {"async_scheduling": False},
        {"DOMINOTREE_CUDA_TREE_ATTENTION": "paths"},
    )
    assert split_variants("chain") == ("chain", {}, {})
    assert split_variants("conditional-v2-torch-step") == (
        "conditional-v2",
        {},
        {"DOMINOTREE_NODE_STEP": "torch"},
    )
    assert split_variants("conditional-fixup")[2] == {"DOMINOTREE_CUDA_TREE_ATTENTION": "fixup"}
    # The longest suffix first: not "-fixup", then "-one-pass" over it.
    assert split_variants("conditional-one-pass-fixup-sync") == (
        "conditional",
        {"async_scheduling": False},
        {"DOMINOTREE_CUDA_TREE_ATTENTION": "one-pass-fixup"},
    )


def test_a_variant_the_engine_did_not_run_stops_the_bench():
    """A -triton or -paths row is only measured if the engine's stats name that step or
    that tree attention (on the GPU; the CPU refuses both at engine start)."""
    method = "conditional-triton-paths"
    environment = split_variants(method)[2]
    ran = {"scorer_step": "triton", "tree_attention": "paths"}
    check_variant_ran(method, environment, ran)
    for stat, other in (("scorer_step", "torch"), ("tree_attention", "fixup")):
        with pytest.raises(RuntimeError, match=f"{stat} '{other}'"):
            check_variant_ran(method, environment, ran | {stat: other})
    check_variant_ran("conditional", {}, {"scorer_step": "torch", "tree_attention": "fixup"})
    # A draft vocabulary is asked for in the speculative config and read in the stats.
    assert split_variants("conditional-v2-triton-vocab32768") == (
        "conditional-v2",
        {},
        {"DOMINOTREE_NODE_STEP": "triton"},
    )
    check_variant_ran("conditional-v2-vocab32768", {}, {"draft_vocab": 32768})
    with pytest.raises(RuntimeError, match="drafted from 0 tokens, not the 32768"):
        check_variant_ran("conditional-v2-vocab32768", {}, {"draft_vocab": 0})
    with pytest.raises(RuntimeError, match="drafted from 8192 tokens, not the 0"):
        check_variant_ran("conditional", {}, {"draft_vocab": 8192})
    # So are the candidates per depth (`-mM`), in either order with the vocabulary.
    assert split_options("chain-v2-m151936") == ("chain-v2", {"candidates": 151936})
    assert split_options("conditional-v2-triton-m32-vocab32768") == (
        "conditional-v2-triton",
        {"candidates": 32, "draft_vocab": 32768},
    )
    check_variant_ran("chain-v2-m151936", {}, {"candidates": 151936})
    with pytest.raises(RuntimeError, match="ran candidates 64, not the 151936 asked for"):
        check_variant_ran("chain-v2-m151936", {}, {"candidates": 64})
    # And the nodes a request drafts (`-bN`): the chain of DFlash's 16 verified rows.
    assert split_options("chain-v2-b15-m64") == ("chain-v2", {"budget": 15, "candidates": 64})
    check_variant_ran("chain-v2-b15", {}, {"budget": 15})
    with pytest.raises(RuntimeError, match="ran budget 16, not the 15 asked for"):
        check_variant_ran("chain-v2-b15", {}, {"budget": 16})
    # And the trees' leaf limit (`-leavesL`).
    assert split_options("conditional-v2-leaves4") == ("conditional-v2", {"max_leaves": 4})
    check_variant_ran("conditional-v2-leaves4", {}, {"max_leaves": 4})
    with pytest.raises(RuntimeError, match="ran max_leaves 0, not the 4 asked for"):
        check_variant_ran("conditional-v2-leaves4", {}, {"max_leaves": 0})
    # And the leaves a step's trees share (`-stepleavesN`; 0: none).
    assert split_options("conditional-v2-stepleaves0-leaves4") == (
        "conditional-v2",
        {"step_leaves": 0, "max_leaves": 4},
    )
    with pytest.raises(RuntimeError, match="ran step_leaves 64, not the 0 asked for"):
        check_variant_ran("conditional-v2-stepleaves0", {}, {"step_leaves": 64})


def test_each_method_runs_cudas_budget():
    """The plugin's methods run the budgets a CUDA user gets, on every device: the
    paper's tree of 16, the chain of DFlash's rows (block - 1 drafts); `-bN` overrides."""
    dirs = {"domino": "/drafter", "dflash": "/dflash"}

    def config(method: str) -> dict:
        return speculative_config(split_variants(method)[0], dirs, split_options(method)[1])

    assert config("conditional-v2") == {
        "method": "dominotree", "model": "/drafter", "budget": 16, "scorer": "conditional",
        "model_runner": "v2",
    }  # fmt: skip
    assert config("chain")["budget"] == 15 and config("chain")["scorer"] == "chain"
    assert config("chain-v2-b16")["budget"] == 16
    assert config("dflash")["num_speculative_tokens"] == 15


def test_a_rows_trees_come_from_the_engines_report():
    """Either runner's report (V2's too: `conditional-v2-paths`): what ran, checked, the
    trees' leaves and the share of one-pass steps; a row without trees shows none."""
    method = "conditional-v2-paths"
    report = {"tree_attention": "paths", "scorer_step": "torch", "mean_leaves": 3.5}
    row = tree_fields(method, split_variants(method)[2], report | {"steps": 8, "one_pass_steps": 0})
    assert row["tree_attention"] == "paths" and row["one_pass_share"] == 0
    assert trees_cell(row) == "paths, 3.5 leaves, 0% one pass"
    one_pass = report | {"tree_attention": "one-pass", "steps": 8, "one_pass_steps": 6}
    assert trees_cell(tree_fields("conditional-v2", {}, one_pass)) == (
        "one-pass, 3.5 leaves, 75% one pass"
    )
    shared = one_pass | {"step_leaves": 64}
    assert trees_cell(tree_fields("conditional-v2", {}, shared)) == (
        "one-pass, 3.5 leaves (64 a step), 75% one pass"
    )
    host = tree_fields("conditional-v2", {}, one_pass | {"graph_builds": 5, "eager_builds": 1})
    assert (host["graph_builds"], host["eager_builds"], host["eager_descriptions"]) == (5, 1, "")
    with pytest.raises(RuntimeError, match="tree_attention 'one-pass'"):
        tree_fields(method, split_variants(method)[2], one_pass)
    chain = tree_fields("chain-v2", {}, {"scorer_step": "torch"})  # vLLM verifies the chain
    assert chain["one_pass_share"] == "" and trees_cell(chain) == "-"


def test_a_table_has_one_prompt_length(tmp_path):
    """Rows of another prompt length in --out stop the bench before any engine starts or
    model is written, naming both lengths and the fix (rows from before the option count
    as 128; other keys: the next test)."""
    row = {"method": "dflash", "batch": 1, "shape": "tiny"}
    (tmp_path / "rows-dflash.json").write_text(json.dumps([row]))
    command = [sys.executable, str(ROOT / "benchmarks" / "round_cost_bench.py")]
    command += ["--out", str(tmp_path), "--shape", "tiny", "--prompt-tokens", "2048"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "prompt_tokens [128], not 2048" in run.stderr and "another --out" in run.stderr
    assert not (tmp_path / "models").exists()


def test_methods_of_several_calls_make_one_table(tmp_path):
    """Rows of earlier calls in the same --out are reported with this call's, in the
    order the methods finished; a method run again replaces its rows."""
    import os

    def finish(method, ms, at):
        path = tmp_path / f"rows-{method}.json"
        path.write_text(json.dumps([{"method": method, "batch": 1, "ms_per_round": ms}]))
        os.utime(path, ns=(at, at))

    finish("dflash", 4.4, 1_000)
    finish("conditional", 6.1, 2_000)
    finish("ar", 3.5, 3_000)
    assert [r["method"] for r in gathered_rows(tmp_path)] == ["dflash", "conditional", "ar"]
    finish("dflash", 4.5, 4_000)
    assert [(r["method"], r["ms_per_round"]) for r in gathered_rows(tmp_path)] == [
        ("conditional", 6.1),
        ("ar", 3.5),
        ("dflash", 4.5),
    ]


def test_verification_is_compared_with_dflashs_at_the_same_batch():
    def row(method, batch, verify=None):
        stages = {} if verify is None else {"verify": verify, "draft": 1.0}
        return {"method": method, "batch": batch, "kernel_ms_per_round_by_stage": stages}

    rows = [row("dflash", 1, 4.0), row("dflash", 16, 5.0), row("conditional", 1, 4.2)]
    rows += [row("conditional", 16, 6.0), row("chain", 4, 3.0), row("ar", 1)]
    assert verify_vs_dflash(rows[2], rows) == 4.2 / 4.0
    assert verify_vs_dflash(rows[3], rows) == 6.0 / 5.0
    assert verify_vs_dflash(rows[4], rows) is None  # no dflash row at batch 4
    assert verify_vs_dflash(rows[5], rows) is None  # no verify stage traced (CPU)


def test_one_table_holds_one_shape_tensor_parallelism_and_prompt_length(tmp_path):
    """A call that would add rows of another shape, tensor parallelism or prompt length to
    a table stops before any engine starts; rows from before a field was recorded count
    as its default."""
    args = argparse.Namespace(
        out=tmp_path, shape="qwen3-8b", tensor_parallel_size=2, prompt_tokens=128
    )
    same = {"shape": "qwen3-8b", "tensor_parallel_size": 2, "prompt_tokens": 128}
    check_one_table([same, same], args)
    check_one_table([], args)
    for key, other in (("shape", "qwen3-4b"), ("tensor_parallel_size", 1), ("prompt_tokens", 2048)):
        with pytest.raises(SystemExit, match=f"{key} .*not {getattr(args, key)}"):
            check_one_table([same, same | {key: other}], args)
    with pytest.raises(SystemExit, match="shape"):
        check_one_table([{"prompt_tokens": 128}], args)  # an older row: qwen3-4b at TP=1
    # The Qwen3-8B shape that tensor parallelism is measured on (issue: 36 layers,
    # hidden 4096, 32 heads, 8 KV heads, the whole Qwen3 vocabulary).
    shape = SHAPES["qwen3-8b"]
    assert (shape["num_hidden_layers"], shape["hidden_size"]) == (36, 4096)
    assert (shape["num_attention_heads"], shape["num_key_value_heads"]) == (32, 8)
    assert shape["vocab_size"] == 151936
