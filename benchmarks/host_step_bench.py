"""Host time of the runner's per-step tree work that the GPU waits for (CPU only).

    python benchmarks/host_step_bench.py --out benchmarks/results/DIR [--before .before]

In a synchronous DominoTree step the host collects the built trees after its one wait
for them (DeviceTreeBuilder.collect) and, before the next forward is launched, describes
the next step's trees (tree_rows + TreeStepBuffers.publish); the GPU idles meanwhile.
This times both for budget-16 trees at batch 1, 16 and 64 on this machine. With
--before (a tree from scripts/before_tree.sh) the earlier package is timed too, in
alternating rounds in child processes, so that both are measured in the same run.
Writes host_step.json / .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BATCHES = (1, 16, 64)
ROWS = 17  # budget 16 + the root


def measure(reps: int) -> dict[str, dict[int, float]]:
    """ms per call of collect and describe, per batch, for the importable package."""
    import numpy as np
    import torch

    from vllm_dominotree.engine.tree_step import TreeStepBuffers, tree_rows
    from vllm_dominotree.tree import device_builder
    from vllm_dominotree.tree.builder import DraftTree

    rng = np.random.default_rng(0)
    out: dict[str, dict[int, float]] = {"collect": {}, "describe": {}}
    for batch in BATCHES:
        trees = []
        rows = torch.full((batch, 4, ROWS), float(device_builder.UNUSED), dtype=torch.float64)
        for r in range(batch):
            tree = DraftTree.root(5)
            for i in range(1, ROWS):
                tree.add(int(rng.integers(1000)), int(rng.integers(i)), -float(i))
            trees.append(tree)
            for field, values in enumerate((tree.tokens, tree.parents, tree.depths, tree.scores)):
                rows[r, field] = torch.tensor(values, dtype=torch.float64)
        if hasattr(device_builder, "_draft_trees"):

            def collect(rows=rows):
                return device_builder._draft_trees(rows.numpy())
        else:  # the package before 2026-12-02

            def collect(rows=rows):
                return [device_builder._draft_tree(*r) for r in rows.tolist()]

        buffers = TreeStepBuffers(8192, torch.device("cpu"))
        num_rows = batch * ROWS
        requests = np.repeat(np.arange(batch), ROWS)
        ranges = [(r * ROWS, (r + 1) * ROWS) for r in range(batch)]

        def describe(trees=trees, buffers=buffers, n=num_rows, req=requests, ranges=ranges):
            step_rows = [
                tree_rows(r, r * ROWS, r * ROWS, 100, t.tokens[1:], t) for r, t in enumerate(trees)
            ]
            buffers.publish(
                step_rows,
                n,
                logits_requests=req,
                logits_ranges=ranges,
                logits_token_rows=np.arange(n),
            )

        for name, fn in (("collect", collect), ("describe", describe)):
            fn()
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            out[name][batch] = 1e3 * (time.perf_counter() - start) / reps
    return out


def child(package_root: Path, reps: int) -> dict:
    """One round in a child process that imports the package under package_root."""
    env = dict(os.environ, PYTHONPATH=str(package_root.resolve()))
    code = (
        f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        f"import host_step_bench as b; print(json.dumps(b.measure({reps})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd="/", capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return f"{os.cpu_count()} cores"


def main() -> None:
    from results_io import command_line, write_results  # benchmarks/ is this script's folder

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--before", type=Path, help="an earlier tree (scripts/before_tree.sh)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=300)
    args = parser.parse_args()
    labels = {"after": Path(__file__).resolve().parents[1]}
    if args.before:
        labels = {"before": args.before, **labels}
    runs: dict[str, list[dict]] = {label: [] for label in labels}
    for _ in range(args.rounds):  # alternating, so that drift hits both alike
        for label, root in labels.items():
            runs[label].append(child(root, args.reps))
    medians = {
        label: {
            part: {b: statistics.median(r[part][str(b)] for r in rounds) for b in BATCHES}
            for part in ("collect", "describe")
        }
        for label, rounds in runs.items()
    }
    rows = [
        [label, part, *(f"{medians[label][part][b]:.3f}" for b in BATCHES)]
        for part in ("collect", "describe")
        for label in labels
    ]
    text = write_results(
        args.out,
        "host_step",
        {"command": command_line(), "device": cpu_name(), "runs": runs, "medians_ms": medians},
        ["code", "host work", *(f"ms, batch {b}" for b in BATCHES)],
        rows,
        intro=[
            f"# Host time of the per-step tree work ({cpu_name()})",
            "",
            f"`{command_line()}`: budget-16 trees (17 rows), median of {args.rounds} "
            f"alternating rounds of {args.reps} calls; collect = the built trees to host "
            "DraftTrees, describe = tree_rows + TreeStepBuffers.publish.",
        ],
    )
    print(text)


if __name__ == "__main__":
    main()
