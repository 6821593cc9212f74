"""bfloat16 on CUDA: how often speculative output leaves the target's own greedy output.

In bfloat16 a verification pass over many rows does not round exactly like one-token
decoding, so any speculative method can flip a near-tie and diverge; losslessness is
then judged as the papers do: the first-divergence rate must be no worse than vLLM's own
DFlash chain on the same prompts, and every divergence must be a flipped near-tie of the
target's (divergence_stats.NEAR_TIE: the output took the runner-up where the target's top
token led it by less than a nat), which a wrong row would not be. Two pairs:
- toy: the toy target with context-dependent attention, and equally good toy drafters
  (a plain DFlash checkpoint for vLLM's "dflash", the Domino one for DominoTree);
- smollm2: SmolLM2-135M-Instruct (a real model, with real near-ties) and the shipped
  drafter; vLLM's "dflash" gets its backbone without the Domino head. Needs
  DOMINOTREE_SMOLLM2 = a converted SmolLM2 folder (scripts/gpu_jobs.sh sets it).
Like for like: DominoTree's budget is DFlash's draft count, so both verify the same
number of rows per request and step (the same matmul shapes and kernel choices).
DOMINOTREE_TP=N runs every engine (the baselines too) at tensor_parallel_size N
(`scripts/gpu_jobs.sh suite tp2`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from divergence_stats import SIGNIFICANCE, diverged, not_near_ties, worse_p_value

from vllm_dominotree.demo.toy_pair import PairSpec, write_drafter, write_pair
from vllm_dominotree.drafter import read_spec
from vllm_dominotree.drafter.checkpoint import load_tensors, write_checkpoint
from vllm_dominotree.training.smollm2 import DRAFTER_DIR

from .sharing import engine_memory, run_engine, smollm2_prompts

NUM_PROMPTS = 100
MAX_TOKENS = 128
TENSOR_PARALLEL = int(os.environ.get("DOMINOTREE_TP", "1"))


def dflash_backbone_of(domino_dir: Path, out: Path) -> Path:
    """The Domino checkpoint's DFlash part (vLLM's "dflash" knows no Domino head)."""
    config = json.loads((domino_dir / "config.json").read_text())
    for key in ("projector_type", "gru_hidden_dim", "emb_dim", "pure_draft_prefix_len"):
        config["dflash_config"].pop(key, None)
    tensors = {
        name: t
        for name, t in load_tensors(read_spec(domino_dir)).items()
        if not name.startswith(("prefix_gru", "embed_proj"))
    }
    return write_checkpoint(out, config, tensors)


def toy_pair(root: Path) -> dict:
    spec = PairSpec(noise=0.8, context=1.4)
    target, domino = write_pair(root, spec)
    dflash = write_drafter(root / "dflash", spec, domino=False, shift_label=False)
    gen = torch.Generator().manual_seed(11)
    prompts = [
        torch.randint(0, 63, (int(n),), generator=gen).tolist()
        for n in torch.randint(1, 40, (NUM_PROMPTS,), generator=gen)
    ]
    return {
        "name": "toy",
        "target": str(target),
        "domino": str(domino),
        "dflash": str(dflash),
        "num_drafts": 7,
        "prompts": prompts,
    }


def smollm2_pair(root: Path) -> dict:
    target, prompts = smollm2_prompts(NUM_PROMPTS)
    return {
        "name": "smollm2",
        "target": target,
        "domino": str(DRAFTER_DIR),
        "dflash": str(dflash_backbone_of(DRAFTER_DIR, root / "dflash")),
        "num_drafts": read_spec(DRAFTER_DIR).block_size - 1,
        "prompts": prompts,
    }


@pytest.fixture(scope="module", params=["toy", "smollm2"])
def pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"bf16-{request.param}")
    return (toy_pair if request.param == "toy" else smollm2_pair)(root)


def generate(pair: dict, speculative_config, margins: bool = False, **engine):
    """(tokens per prompt, the plugin's stats, vLLM's spec-decode counters or None
    [, margins: run_engine's])."""
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2 if margins else None
    )
    return run_engine(
        pair["target"],
        pair["prompts"],
        params,
        speculative_config,
        margins=margins,
        dtype="bfloat16",
        max_model_len=2048,
        tensor_parallel_size=TENSOR_PARALLEL,
        **engine_memory(kv_gib=4),
        **engine,
    )


@pytest.fixture(scope="module")
def baselines(pair) -> dict:
    """No speculation, and vLLM's DFlash with the same draft count on its default (V2)
    runner. With DOMINOTREE_BF16_BASELINES set to a folder they are shared between test
    processes through it: read when an earlier run saved them there, saved otherwise,
    and with DOMINOTREE_BF16_BASELINES_WAIT_S also set, waited for that long first:
    scripts/gpu_jobs.sh's suite runs each variant below in its own process beside the
    process that computes the baselines (`-k baselines[toy]`)."""
    saved = os.environ.get("DOMINOTREE_BF16_BASELINES")
    path = None
    if saved:
        tp = f"-tp{TENSOR_PARALLEL}" if TENSOR_PARALLEL > 1 else ""
        key = f"{pair['name']}{tp}-{len(pair['prompts'])}x{MAX_TOKENS}-margins"
        path = Path(saved) / f"{key}.json"
        wait_s = float(os.environ.get("DOMINOTREE_BF16_BASELINES_WAIT_S", "0"))
        deadline = time.monotonic() + wait_s
        while wait_s and not path.exists():
            if time.monotonic() > deadline:
                pytest.fail(f"no baselines in {path} after {wait_s:.0f} s (run -k baselines)")
            time.sleep(5)
        if path.exists():
            found = json.loads(path.read_text())
            if found["prompts"] == pair["prompts"]:
                print(f"baselines read from {path}")
                return found["baselines"]
    dflash = {
        "method": "dflash",
        "model": pair["dflash"],
        "num_speculative_tokens": pair["num_drafts"],
    }
    want, _, margins = generate(pair, None, margins=True)
    found = {"want": want, "margins": margins}
    found["dflash"] = diverged(generate(pair, dflash)[0], found, "vLLM dflash")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")  # readers never see half a file
        partial.write_text(json.dumps({"prompts": pair["prompts"], "baselines": found}))
        partial.rename(path)
    return found


def test_baselines(baselines):
    """The baselines alone (scripts/gpu_jobs.sh runs this first to save them): vLLM's
    DFlash leaves the target's output on few prompts, or the comparison says nothing, and
    only at near-ties, or NEAR_TIE is no bar."""
    assert len(baselines["dflash"]) <= NUM_PROMPTS // 10
    assert not_near_ties(baselines["dflash"]) == []


# Every scorer with the plugin's defaults (what a user runs): on FA3 ("auto") a step whose
# requests are all trees runs its attention once, over path requests that hold every row
# (engine/tree_paths.py), so each row rounds as decoding its own path would.
# Variants by name (a prefix, so that `-k smollm2-conditional` selects one variant):
# `paths-conditional`, the stock pass plus path requests for the branched rows
# (DOMINOTREE_CUDA_TREE_ATTENTION=paths); `fixup-conditional`, the stock pass plus the
# Triton fix-up in FA3's steps (kernels/tree_attention_fa3.py; the fix-up in its own
# rounding left SmolLM2's output on 64 of 100 prompts, H200 2026-12-02),
# `one-pass-fixup-conditional`, that kernel for every row and no stock pass;
# `one-pass-merge-conditional`, FA3 over each prefix and the Triton tree part, merged
# (kernels/tree_merge.py; `v2-one-pass-merge-conditional` on V2: expected to fail, see
# MERGE_ROUNDING); and
# `triton-conditional`, the Triton node step and pop (DOMINOTREE_NODE_STEP=triton; it
# needs a top-M restriction, and the toy vocabulary is 64 tokens: M 32); `v2-...`, the
# plugin on vLLM's V2 runner (model_runner "v2": one pass on FA3 by default, as on V1;
# `v2-paths-conditional`, the stock pass and path requests; `v2-triton-conditional`, the
# Triton node step in V2's draft graph).
VARIANTS = {
    "chain": ({}, {}),
    "marginal": ({}, {}),
    "conditional": ({}, {}),
    "paths-conditional": ({}, {"DOMINOTREE_CUDA_TREE_ATTENTION": "paths"}),
    "fixup-conditional": ({}, {"DOMINOTREE_CUDA_TREE_ATTENTION": "fixup"}),
    "one-pass-fixup-conditional": ({}, {"DOMINOTREE_CUDA_TREE_ATTENTION": "one-pass-fixup"}),
    "one-pass-merge-conditional": ({}, {"DOMINOTREE_CUDA_TREE_ATTENTION": "one-pass-merge"}),
    "triton-conditional": ({"candidates": 32}, {"DOMINOTREE_NODE_STEP": "triton"}),
    "v2-chain": ({"model_runner": "v2"}, {}),
    "v2-conditional": ({"model_runner": "v2"}, {}),
    "v2-paths-conditional": ({"model_runner": "v2"}, {"DOMINOTREE_CUDA_TREE_ATTENTION": "paths"}),
    "v2-one-pass-merge-conditional": (
        {"model_runner": "v2"},
        {"DOMINOTREE_CUDA_TREE_ATTENTION": "one-pass-merge"},
    ),
    "v2-triton-conditional": (
        {"model_runner": "v2", "candidates": 32},
        {"DOMINOTREE_NODE_STEP": "triton"},
    ),
}
# FA3 returns the prefix part normalized and rounded to bf16, so merged rows cannot round
# as decoding's: on an H100 (2026-12-05d) both merge variants left the toy target's
# output on 16 of 100 prompts against vLLM DFlash's 1 (all near-ties).
MERGE_ROUNDING = pytest.mark.xfail(
    strict=True, reason="one-pass-merge rounds as two merged softmaxes, not as decoding"
)


@pytest.mark.parametrize(
    "variant",
    [pytest.param(v, marks=MERGE_ROUNDING) if "one-pass-merge" in v else v for v in VARIANTS],
)
def test_first_divergence_no_worse_than_vllm_dflash(pair, variant, request):
    scorer = variant.rpartition("-")[2]
    options, env = VARIANTS[variant]
    config = {
        "method": "dominotree",
        "model": pair["domino"],
        "budget": pair["num_drafts"],
        "scorer": scorer,
        **options,
    }
    tokens, stats = generate(pair, config, env=env)
    name = f"dominotree {variant} ({stats.get('tree_attention', 'vLLM verification')})"
    if options.get("model_runner") == "v2":
        assert stats["model_runner"] == "v2"
        assert stats["vllm:spec_decode_num_accepted_tokens"] > 0
        # The chain keeps vLLM's verification; trees on FA3 take one pass by default.
        attention = env.get("DOMINOTREE_CUDA_TREE_ATTENTION", "one-pass")
        assert stats.get("tree_attention") == (None if scorer == "chain" else attention)
        assert stats["scorer_step"] == env.get("DOMINOTREE_NODE_STEP", stats["scorer_step"])
        if scorer != "chain":
            # Every step of trees alone ran one pass (a step with a prefill beside trees
            # does not): most steps.
            one_pass, takes_one_pass = stats["one_pass_steps"], attention.startswith("one-pass")
            assert one_pass > 0.5 * stats["steps"] if takes_one_pass else one_pass == 0
            # and its FULL graphs were captured without the stock pass
            assert (stats["one_pass_graphs"] > 0) == takes_one_pass
    else:
        check_tree_runner_stats(stats, scorer, env)
    # The baselines only now: a process of its own may still be computing them.
    baselines = request.getfixturevalue("baselines")
    found = diverged(tokens, baselines, name)
    # No worse: not significantly more prompts than vLLM's DFlash leaves.
    p_value = worse_p_value(len(found), len(baselines["dflash"]), NUM_PROMPTS)
    print(f"{name}: one-sided p against vLLM dflash's {len(baselines['dflash'])}: {p_value:.3f}")
    # Every divergence a flipped near-tie of the target's: rounding, not a wrong row.
    assert not_near_ties(found) == []
    assert p_value >= SIGNIFICANCE


def check_tree_runner_stats(stats: dict, scorer: str, env: dict) -> None:
    """The V1 tree runner ran what the variant asks for."""
    # bf16 on the H200 runs FA3: the default tree attention ("auto") is one pass.
    attention = env.get("DOMINOTREE_CUDA_TREE_ATTENTION", "one-pass")
    assert stats["tree_attention"] == attention
    assert (stats["one_pass_steps"] > 0) == attention.startswith("one-pass")
    # One pass's FULL graphs were captured without the stock pass.
    assert (stats["one_pass_graphs"] > 0) == attention.startswith("one-pass")
    if "DOMINOTREE_NODE_STEP" in env:
        assert stats["scorer_step"] == env["DOMINOTREE_NODE_STEP"]
    if attention.endswith("fixup"):
        assert stats["fixup_rounding"] == "fa3"
    if scorer != "chain":
        assert stats["sibling_accepts"] > 0  # trees that branch, and rows that were fixed
