"""Where DominoTree's greedy output leaves the target's own, under the same engine settings:
a diagnostic for the bf16 divergence test (tests/gpu/test_bf16_divergence.py).

    python benchmarks/divergence_probe.py --target DIR --drafter DIR --out DIR \\
        [--dtype bfloat16] [--prompts 100] [--max-tokens 128] [--budget 15] \\
        [--attention-backend TRITON_ATTN] [--enforce-eager] \\
        [--configs conditional conditional-sync chain]

The target alone runs first with the same dtype, attention backend and graph mode, then
each config, all in this process, one engine at a time. A config is a scorer with
suffixes (CONFIG_SUFFIXES): -sync (vLLM's asynchronous scheduling off), -paths / -fixup
(the tree rows' attention mode), -b4 (4 requests at a time), -check (every recomputed row
against the dense reference, engine/attention_check.py: eager, so give --enforce-eager
too, that the target alone runs eager as well), e.g. `conditional-sync-b4`. Per config:
how many prompts leave the target's output and where they first do, and the plugin's
counters. The prompts are the chat
prompts of the GPU tests (first turns spread over HumanEval, MT-Bench and MATH-500).
"""

from __future__ import annotations

import argparse
import gc
import os
from pathlib import Path

import torch
from results_io import command_line, write_results  # benchmarks/ is this script's folder
from variants import split_suffixes

# Suffix -> (engine arguments, environment).
CONFIG_SUFFIXES = {
    "-sync": ({"async_scheduling": False}, {}),
    "-paths": ({}, {"DOMINOTREE_CUDA_TREE_ATTENTION": "paths"}),
    "-fixup": ({}, {"DOMINOTREE_CUDA_TREE_ATTENTION": "fixup"}),
    "-b4": ({"max_num_seqs": 4}, {}),
    # Every recomputed row against the dense reference (engine/attention_check.py; eager).
    "-check": ({"enforce_eager": True}, {"DOMINOTREE_CHECK_TREE_ATTENTION": "1"}),
}


def chat_prompts(target: str, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from vllm_dominotree.evaluation.datasets import chat_token_ids, load_dataset

    tokenizer = AutoTokenizer.from_pretrained(target)
    turns = [c[0] for name in ("humaneval", "mtbench", "math500") for c in load_dataset(name)]
    return [chat_token_ids(tokenizer, t) for t in turns[:: len(turns) // count]][:count]


def generate(args, prompts, speculative_config, engine: dict, env: dict):
    from vllm import LLM, SamplingParams

    # GPU: a fixed KV cache, so that probes can share the GPU (as the tests' engines do).
    memory = (
        {"gpu_memory_utilization": 0.08, "kv_cache_memory_bytes": 4 * 2**30}
        if torch.cuda.is_available()
        else {}
    )
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # read by the engine's workers, spawned below
    try:
        llm = LLM(
            model=args.target,
            dtype=args.dtype,
            max_model_len=2048,
            seed=0,
            **memory,
            kernel_config={"enable_jit_warmup": False},
            attention_backend=args.attention_backend,
            speculative_config=speculative_config,
            **({"enforce_eager": args.enforce_eager} | engine),
        )
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    stats = llm.collective_rpc("dominotree_stats")[0] if speculative_config else {}
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return tokens, stats


def first_divergences(outputs: list[list[int]], want: list[list[int]]) -> dict[int, int]:
    """prompt -> the first position where its output leaves the target's."""
    found = {}
    for p, (got, ref) in enumerate(zip(outputs, want, strict=True)):
        i = next((i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if a != b), None)
        if i is not None:
            found[p] = i
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--budget", type=int, default=15)
    parser.add_argument("--attention-backend", default=None, help="e.g. TRITON_ATTN")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--configs", nargs="+", default=["conditional", "conditional-sync"])
    args = parser.parse_args()
    prompts = chat_prompts(args.target, args.prompts)
    want, _ = generate(args, prompts, None, {}, {})
    rows, table = [], []
    for config in args.configs:
        scorer, engine, env = split_suffixes(config, CONFIG_SUFFIXES)
        speculative = {
            "method": "dominotree",
            "model": args.drafter,
            "scorer": scorer,
            "budget": args.budget,
        }
        tokens, stats = generate(args, prompts, speculative, engine, env)
        found = first_divergences(tokens, want)
        rows.append({"config": config, "diverged": found, "stats": stats})
        earliest = sorted(found.values())[:12]
        check = stats.get("tree_attention_check") or {}
        table.append(
            [
                config,
                len(found),
                earliest,
                stats.get("sibling_accepts"),
                stats.get("tree_attention"),
                f"{check['max_error']:.2e} over {check['rows']} rows" if check else "-",
            ]
        )
        print(config, len(found), "of", len(prompts), "diverge", sorted(found.values()), flush=True)
        write_results(
            args.out,
            "divergence_probe",
            {"command": command_line(), "args": vars(args), "rows": rows},
            [
                "config",
                "prompts diverging",
                "first positions (12 earliest)",
                "sibling accepts",
                "tree attention",
                "recomputed rows' largest error (-check)",
            ],
            table,
            [f"# First divergence from the target alone ({args.dtype})", "", f"`{command_line()}`"],
        )


if __name__ == "__main__":
    main()
