"""vLLM's Model Runner V2 runs on this CPU (tests/engine/v2_on_cpu.py), the ground the
V2 port's tests stand on: the toy target decodes the same greedy tokens on V1 and V2,
and vLLM's own DFlash on V2 gives them too, with drafts accepted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .conftest import assert_runs_follow_the_target
from .v2_on_cpu import SAMPLED_LAW

HERE = Path(__file__).parent


def run_engine(runner: str, target: str, sampled: int = 0, **options) -> dict:
    command = [sys.executable, str(HERE / "v2_on_cpu.py"), runner, target, json.dumps(options)]
    command += [str(sampled)] if sampled else []
    run = subprocess.run(command, capture_output=True, text=True, timeout=900)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_v2_runner_decodes_as_v1_with_and_without_dflash(pair_dirs):
    v1 = run_engine("v1", pair_dirs["target"])
    v2 = run_engine("v2", pair_dirs["target"])
    dflash = {"method": "dflash", "model": pair_dirs["dflash"], "num_speculative_tokens": 7}
    v2_dflash = run_engine("v2", pair_dirs["target"], speculative_config=dflash)
    assert v1["runner"].startswith("vllm.v1.worker.cpu_model_runner.")
    for run in (v2, v2_dflash):
        assert run["runner"] == "vllm.v1.worker.cpu.model_runner.CPUModelRunner", run["runner"]
    assert v2["tokens"] == v1["tokens"]
    assert v2_dflash["tokens"] == v1["tokens"]
    assert v2_dflash["spec"]["vllm:spec_decode_num_accepted_tokens"] > 0


def test_chain_on_the_v2_runner_drafts_and_accepts_as_on_v1(pair_dirs):
    """The plugin's chain on vLLM's V2 runner (model_runner "v2": vLLM's DFlash speculator
    drafting Domino's chain, vLLM's own verification) gives the target's greedy tokens
    and accepts, position by position, exactly what the V1 tree runner's chain accepts:
    the same drafts (the V1 runner's chain is Domino's decoder: tests/engine/test_generate.py)."""
    chain = {"method": "dominotree", "model": pair_dirs["drafter"], "scorer": "chain"}
    target = pair_dirs["target"]
    v1 = run_engine("v1", target, speculative_config=chain)
    v2 = run_engine("v2", target, speculative_config={**chain, "model_runner": "v2"})
    plain = run_engine("v1", target)
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


def test_sampled_chain_on_the_v2_runner_follows_the_target(pair_dirs):
    """Seeded sampled requests through the V2 runner's chain (deterministic drafts, so
    vLLM's rejection sampler accepts a draft with the target's probability of it) follow
    the target's own law, drafts accepted."""
    chain = {"method": "dominotree", "model": pair_dirs["drafter"], "scorer": "chain"}
    run = run_engine(
        "v2", pair_dirs["target"], sampled=600, speculative_config={**chain, "model_runner": "v2"}
    )
    assert run["spec"]["vllm:spec_decode_num_accepted_tokens"] > 0
    assert_runs_follow_the_target(run["tokens"], pair_dirs["target"], SAMPLED_LAW)
