"""Tree build time per round: eager vs CUDA-graph builder, on Qwen3-4B-shaped weights.

    python benchmarks/builder_bench.py --out benchmarks/results [--device cuda]

Random Domino head of the released Qwen3-4B b16 shapes (hidden 2560, vocab 151936,
GRU 1024, rank 256, 16 drafts), random drafter outputs. A round's build time is
prepare (per-depth top-M, gathers) + the heap loop until the tree is full, measured
with device syncs. Per configuration it also checks that the graph builder's trees are
identical to the eager builder's. Writes builder_bench.json and builder_bench.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from results_io import command_line, write_results  # benchmarks/ is this script's folder

from vllm_dominotree.toy_pair import random_domino_head
from vllm_dominotree.tree import TreeShape, build_trees, make_scorer

HIDDEN, VOCAB, GRU, RANK, K = 2560, 151936, 1024, 256, 16


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(head, embed, device, batch, budget, candidates, graphs, rounds, inputs):
    shape = TreeShape(budget=budget, max_depth=K, max_children=budget)
    scorer = make_scorer("conditional", head, embed, shape=shape, candidates=candidates,
                         prefix_len=1, max_requests=batch, use_cuda_graphs=graphs)  # fmt: skip
    times, prepare_times, trees = [], [], []
    for i in range(rounds + 3):  # 3 warm-up rounds (graph capture happens there)
        hidden, base, anchors = inputs[i % len(inputs)]
        sync(device)
        t0 = time.perf_counter()
        scorer.prepare(hidden, base)
        sync(device)
        t1 = time.perf_counter()
        built = build_trees(scorer, anchors, shape)
        t2 = time.perf_counter()  # build_trees ends on a host read: already synced
        if i >= 3:
            times.append(t2 - t0)
            prepare_times.append(t1 - t0)
        if i < len(inputs):
            trees.append([(t.tokens, t.parents, t.scores) for t in built])
    return {
        "build_ms_median": 1e3 * statistics.median(times),
        "build_ms_p90": 1e3 * sorted(times)[int(0.9 * len(times))],
        "prepare_ms_median": 1e3 * statistics.median(prepare_times),
        "per_pop_us": 1e6 * (statistics.median(times) - statistics.median(prepare_times)) / budget,
    }, trees


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--candidates", type=int, nargs="+", default=[32, 64, 128])
    args = parser.parse_args()
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    head = random_domino_head(
        hidden=HIDDEN, vocab=VOCAB, gru_hidden=GRU, emb_dim=RANK, device=device, dtype=dtype
    )
    embed = torch.randn(VOCAB, HIDDEN, device=device).to(dtype)
    rows = []
    for batch in args.batches:
        inputs = []
        for _ in range(4):
            hidden = torch.randn(batch, K, HIDDEN, device=device).to(dtype)
            base = (4 * torch.randn(batch, K, VOCAB, device=device)).to(dtype)
            anchors = torch.randint(0, VOCAB, (batch,)).tolist()
            inputs.append((hidden, base, anchors))
        for budget in args.budgets:
            for m in args.candidates:
                modes = [False, True] if device == "cuda" else [False]
                results = {}
                for graphs in modes:
                    stats, trees = measure(
                        head, embed, device, batch, budget, m, graphs, args.rounds, inputs
                    )
                    results[graphs] = (stats, trees)
                    row = {
                        "batch": batch,
                        "budget": budget,
                        "candidates": m,
                        "builder": "graph" if graphs else "eager",
                        **stats,
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                if len(results) == 2:
                    same = results[False][1] == results[True][1]
                    rows[-1]["trees_equal_eager"] = same
                    rows[-2]["trees_equal_eager"] = same
                    if not same:
                        raise SystemExit(f"graph trees differ from eager: {rows[-1]}")
    meta = {
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.machine(),
        "torch": torch.__version__,
        "dtype": str(dtype),
        "shapes": {"hidden": HIDDEN, "vocab": VOCAB, "gru": GRU, "rank": RANK, "drafts": K},
        "rounds": args.rounds,
        "command": command_line(),
    }
    intro = [
        f"# Tree build time per round ({meta['device']}, {meta['dtype']}, torch {meta['torch']})",
        "",
        f"`{meta['command']}`; median of {args.rounds} rounds after 3 warm-up rounds. build =",
        "prepare (per-depth top-M and gathers) + heap loop; per pop = (build - prepare) / budget.",
    ]
    header = ["batch", "budget", "M", "builder", "build ms (median)", "p90", "prepare ms",
              "per pop us", "trees == eager"]  # fmt: skip
    table = [[r["batch"], r["budget"], r["candidates"], r["builder"],
              f"{r['build_ms_median']:.3f}", f"{r['build_ms_p90']:.3f}",
              f"{r['prepare_ms_median']:.3f}", f"{r['per_pop_us']:.1f}",
              r.get("trees_equal_eager", "-")] for r in rows]  # fmt: skip
    write_results(args.out, "builder_bench", {"meta": meta, "rows": rows}, header, table, intro)


if __name__ == "__main__":
    main()
