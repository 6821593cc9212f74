"""The build stage's cost by draft vocabulary size, on this CPU, outside the engine.

    python benchmarks/draft_vocab_bench.py --target SMOLLM2_DIR --out benchmarks/results/DIR \
        [--sizes 0 4096 8192 16384] [--budget 4]

For the shipped SmolLM2 drafter and its target's lm_head, in bfloat16 with one torch
thread (by default), one request: ms per step of the drafter's logits
over `budget` depths, the scorer's preparation (top-M, rows of the correction) and the
host heap's build of a conditional tree, for each draft vocabulary size (0: the whole
vocabulary) and each dtype of the scorer's per-node step (the head's bfloat16, and the
float32 the CPU engine takes). The drafter's rows are random, so only the times mean
anything here (the harness measures what a vocabulary costs in accepted tokens). Writes
draft_vocab_bench.json / .md.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from pathlib import Path

import torch
from results_io import command_line, write_results  # benchmarks/ is this script's folder

from vllm_dominotree.config import DominoTreeConfig
from vllm_dominotree.drafter import Drafter
from vllm_dominotree.drafter.draft_vocab import draft_vocab_ids
from vllm_dominotree.training.smollm2 import DRAFTER_DIR
from vllm_dominotree.tree import build_trees, make_scorer


def timed(fn, reps: int) -> float:
    """Median ms of `reps` calls after two warm-up calls."""
    fn(), fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sizes", type=int, nargs="+", default=[0, 4096, 8192, 16384])
    parser.add_argument("--budget", type=int, default=4)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype)
    lm_head = target.get_output_embeddings().weight.detach()  # [V, H]
    embed = target.get_input_embeddings().weight.detach()
    drafter = Drafter.load(DRAFTER_DIR, dtype=dtype)
    config = DominoTreeConfig(budget=args.budget)
    shape = config.tree_shape(drafter.spec.num_drafts)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, shape.max_depth, lm_head.shape[1], generator=gen).to(dtype)
    rows = []
    for size, step_dtype in itertools.product(args.sizes, (dtype, torch.float32)):
        vocab_ids = draft_vocab_ids(DRAFTER_DIR, size, lm_head.shape[0]) if size else None
        head = lm_head if vocab_ids is None else lm_head[vocab_ids].contiguous()
        scorer = make_scorer(
            "conditional",
            drafter.head,
            embed,
            shape=shape,
            candidates=config.candidates,
            prefix_len=drafter.spec.pure_draft_prefix_len,
            max_requests=1,
            vocab_ids=vocab_ids,
            step_dtype=step_dtype,
        )
        logits = torch.nn.functional.linear(hidden[0], head)[None]

        def prepare(scorer=scorer, logits=logits):
            scorer.prepare(hidden, logits)

        prepare()
        with torch.inference_mode():
            ms = {
                "logits": timed(
                    lambda head=head: torch.nn.functional.linear(hidden[0], head), args.reps
                ),
                "prepare": timed(prepare, args.reps),
                "build": timed(lambda scorer=scorer: build_trees(scorer, [1], shape), args.reps),
            }
        step = str(step_dtype).removeprefix("torch.")
        rows.append({"draft_vocab": size, "rows": head.shape[0], "step_dtype": step, "ms": ms})
        print(size, step, ms, flush=True)
    header = ["draft vocabulary", "node step", "logits ms", "prepare ms", "build ms", "sum ms"]
    table = [
        [
            r["draft_vocab"] or f"whole ({r['rows']})",
            r["step_dtype"],
            *(f"{r['ms'][k]:.2f}" for k in ("logits", "prepare", "build")),
            f"{sum(r['ms'].values()):.2f}",
        ]
        for r in rows
    ]
    intro = [
        "# The build stage by draft vocabulary size (CPU, bfloat16, one thread)",
        "",
        f"    {command_line()}",
        "",
        f"SmolLM2-135M's lm_head and the shipped drafter's head, one request, budget "
        f"{args.budget} ({shape.max_depth} depths), random rows, {args.threads} torch "
        f"thread(s); median of {args.reps} calls.",
    ]
    write_results(
        args.out, "draft_vocab_bench", {"args": vars(args), "rows": rows}, header, table, intro
    )


if __name__ == "__main__":
    main()
