"""The plugin on vLLM's Model Runner V2 (option model_runner "v2"), on this CPU
(tests/engine/v2_on_cpu.py: each engine in a process of its own): V2 itself decodes as
V1, with and without vLLM's DFlash; the plugin's chain and trees on V2 accept exactly
what the V1 tree runner accepts and give the target's tokens, greedy and sampled."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import assert_runs_follow_the_target
from .test_robustness import PREEMPT_MAX_TOKENS, PREEMPT_PROMPTS, _prompt
from .v2_on_cpu import SAMPLED_LAW

V2_COUNTERS = ("steps", "trees", "tree_nodes", "accepted_tokens", "sibling_accepts",
               "tree_leaves", "kv_moves", "graph_accepts", "eager_accepts",
               "one_pass_steps")  # fmt: skip

HERE = Path(__file__).parent


def run_engine(runner: str, target: str, sampled: int = 0, **options) -> dict:
    command = [sys.executable, str(HERE / "v2_on_cpu.py"), runner, target, json.dumps(options)]
    command += [str(sampled)] if sampled else []
    run = subprocess.run(command, capture_output=True, text=True, timeout=900)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.fixture(scope="module")
def plain(pair_dirs):
    return run_engine("v1", pair_dirs["target"])


def test_v2_runner_decodes_as_v1_with_and_without_dflash(pair_dirs, plain):
    v1 = plain
    v2 = run_engine("v2", pair_dirs["target"])
    dflash = {"method": "dflash", "model": pair_dirs["dflash"], "num_speculative_tokens": 7}
    v2_dflash = run_engine("v2", pair_dirs["target"], speculative_config=dflash)
    assert v1["runner"].startswith("vllm.v1.worker.cpu_model_runner.")
    for run in (v2, v2_dflash):
        assert run["runner"] == "vllm.v1.worker.cpu.model_runner.CPUModelRunner", run["runner"]
    assert v2["tokens"] == v1["tokens"]
    assert v2_dflash["tokens"] == v1["tokens"]
    assert v2_dflash["spec"]["vllm:spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("scorer", ["chain", "conditional", "marginal"])
def test_the_v2_runner_drafts_and_accepts_as_the_tree_runner(pair_dirs, plain, scorer):
    """The plugin on vLLM's V2 runner (model_runner "v2": vLLM's DFlash speculator drafting
    Domino's chain or trees; the chain verified by vLLM's own sampler, trees by the tree
    steps at V2's hooks) gives the target's greedy tokens and accepts, position by
    position, exactly what the V1 tree runner accepts: the same drafts, the same paths.
    V2 runs traced, as the round-cost bench traces it: its stages are named (the host's
    time in each is counted), and tracing changes nothing."""
    config = {"method": "dominotree", "model": pair_dirs["drafter"], "scorer": scorer, "budget": 16}
    config["score_temperature"] = 1.5  # both runners' scorers take it (the same trees)
    config["step_nodes"] = 0  # V1's CPU default shares nodes over a step; V2 verifies all
    target = pair_dirs["target"]
    v1 = run_engine("v1", target, speculative_config=config)
    v2 = run_engine("v2", target, speculative_config={**config, "model_runner": "v2"}, trace=True)
    assert v2["runner"] == "vllm_dominotree.engine.cpu_worker.DominoTreeCPUModelRunnerV2"
    assert v1["runner"] == "vllm_dominotree.engine.cpu_worker.DominoTreeCPUModelRunner"
    assert v2["tokens"] == v1["tokens"] == plain["tokens"]
    for key in (
        "vllm:spec_decode_num_drafts",
        "vllm:spec_decode_num_accepted_tokens",
        "vllm:spec_decode_num_accepted_tokens_per_pos",
    ):
        assert v2["spec"][key] == v1["spec"][key], key
    assert v2["spec"]["vllm:spec_decode_num_accepted_tokens"] > 0
    stages = {"verify", "sample", "draft"} | (
        set() if scorer == "chain" else {"prepare", "accept", "commit"}
    )
    assert set(v2["host_ms"]) == stages and all(v2["host_ms"].values()), v2["host_ms"]
    # The runners' reports say which verified: V2's, its scorer and tree attention, and
    # for trees V1's step counters with the same values (the same trees, the same
    # accepts), in the report and in the /metrics block.
    assert v1["report"]["model_runner"] == "v1" and v1["report"]["steps"] > 0
    report = v2["report"]
    assert report["model_runner"] == "v2" and report["scorer"] == scorer
    assert report["score_temperature"] == v1["report"]["score_temperature"] == 1.5
    # No CUDA graphs on CPU: none captured, none widened (graph_sizes.py).
    assert report["graph_tokens"] == v1["report"]["graph_tokens"] == 0
    if scorer == "chain":
        assert "tree_attention" not in report and "steps" not in report
        return
    assert report["tree_attention"] == "cpu"
    for name in V2_COUNTERS:
        assert report[name] == v2["metrics"][name], name
        if name != "eager_accepts":  # V1 also counts accepts of steps without trees
            assert report[name] == v1["report"][name], name
    assert report["eager_accepts"] == report["steps"]  # CPU: no accept graphs
    assert report["eager_builds"] >= report["steps"] and report["graph_builds"] == 0  # the heap
    assert report["eager_descriptions"] == report["steps"] and report["graph_descriptions"] == 0
    assert report["accepted_tokens"] == v2["spec"]["vllm:spec_decode_num_accepted_tokens"]
    assert report["mean_accept_length"] == v1["report"]["mean_accept_length"]
    if scorer == "conditional":
        assert report["sibling_accepts"] > 0 and report["kv_moves"] > 0


@pytest.mark.parametrize("scorer", ["chain", "conditional"])
def test_sampled_requests_on_the_v2_runner_follow_the_target(pair_dirs, scorer):
    """Seeded sampled requests through the V2 runner follow the target's own law, drafts
    accepted: the chain's through vLLM's rejection sampler (deterministic drafts: a draft
    x is accepted with the target's probability of x), the trees' through the tree
    acceptance (the target's token drawn at every row)."""
    config = {
        "method": "dominotree",
        "model": pair_dirs["drafter"],
        "scorer": scorer,
        "budget": 16,
        "model_runner": "v2",
    }
    run = run_engine("v2", pair_dirs["target"], sampled=600, speculative_config=config)
    assert run["spec"]["vllm:spec_decode_num_accepted_tokens"] > 0
    assert_runs_follow_the_target(run["tokens"], pair_dirs["target"], SAMPLED_LAW)


def test_trees_on_the_v2_runner_through_preemption_and_chunked_prefills(pair_dirs):
    """A KV cache too small for the batch (requests preempted and recomputed) and a step
    token budget below the long prompts' lengths (prefills in chunks beside trees, which
    V2 orders after the decodes): the target's greedy tokens still."""
    prompts = [*PREEMPT_PROMPTS, _prompt(1, 190), _prompt(2, 150)]
    options = {"prompts": prompts, "max_tokens": PREEMPT_MAX_TOKENS}
    config = {
        "method": "dominotree",
        "model": pair_dirs["drafter"],
        "budget": 16,
        "model_runner": "v2",
    }
    small = {
        "num_gpu_blocks_override": 16,
        "block_size": 32,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 128,
    }
    want = run_engine("v1", pair_dirs["target"], **options)
    got = run_engine("v2", pair_dirs["target"], speculative_config=config, **small, **options)
    assert got["preemptions"] > 0, "the KV cache was not small enough to force a preemption"
    assert got["spec"]["vllm:spec_decode_num_accepted_tokens"] > 0
    assert got["tokens"] == want["tokens"]
