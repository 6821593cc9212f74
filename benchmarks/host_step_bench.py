"""Host time of the runner's per-step tree work that the GPU waits for (CPU only).

    python benchmarks/host_step_bench.py --out benchmarks/results/DIR [--before .before]

Before 2026-12-02 (synchronous scheduling) the host collected the built trees after its
one wait for them (DeviceTreeBuilder.collect) and described the next step's trees from
them (tree_rows + TreeStepBuffers.publish) while the GPU idled. Since then the step
describes its layout on the host and gathers the trees' fields from the builder's table
(TreeStepBuffers.publish with the table; on CUDA the gather is one graph replay, here on
the CPU it runs as torch ops), and nothing is collected. This times what each package
does per step for budget-16 trees at batch 1, 16 and 64 on this machine ("collect" is
"-" where the package no longer does it). With --before (a tree from
scripts/before_tree.sh) the earlier package is timed too, in alternating rounds in child
processes, so that both are measured in the same run. Writes host_step.json / .md.
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

    from vllm_dominotree.engine import tree_step
    from vllm_dominotree.tree import device_builder
    from vllm_dominotree.tree.builder import DraftTree

    synchronous = hasattr(tree_step, "tree_rows")  # the package before 2026-12-02
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

        def collect(rows=rows):  # timed for the earlier package only (its signature)
            return device_builder._draft_trees(rows.numpy())

        buffers = tree_step.TreeStepBuffers(8192, torch.device("cpu"))
        num_rows = batch * ROWS
        requests = np.repeat(np.arange(batch), ROWS)
        ranges = [(r * ROWS, (r + 1) * ROWS) for r in range(batch)]
        layout = dict(logits_requests=requests, logits_ranges=ranges)
        if synchronous:

            def describe(trees=trees, buffers=buffers, n=num_rows, layout=layout):
                step_rows = [
                    tree_step.tree_rows(r, r * ROWS, r * ROWS, 100, t.tokens[1:], t)
                    for r, t in enumerate(trees)
                ]
                buffers.publish(step_rows, n, logits_token_rows=np.arange(n), **layout)

        else:
            from vllm_dominotree.tree.ancestry import NUM_FIELDS, describe_slots

            table = torch.zeros(NUM_FIELDS, batch + 1, ROWS, dtype=torch.long)
            describe_slots(*device_builder.slot_tensors(trees, ROWS), table[:, :batch])

            def describe(batch=batch, buffers=buffers, n=num_rows, layout=layout, table=table):
                step_rows = [
                    tree_step.TreeRows(r, r * ROWS, r * ROWS, 100, ROWS, r) for r in range(batch)
                ]
                buffers.publish(step_rows, n, logits_token_rows=np.arange(n), table=table, **layout)

        parts = [("collect", collect)] if synchronous else []  # nothing collected since
        parts.append(("describe", describe))
        for name, fn in parts:
            fn()
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            out[name][batch] = 1e3 * (time.perf_counter() - start) / reps
    return out


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


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
            part: {
                b: statistics.median(r[part][str(b)] for r in rounds) if rounds[0][part] else None
                for b in BATCHES
            }
            for part in ("collect", "describe")
        }
        for label, rounds in runs.items()
    }
    rows = [
        [label, part, *(_ms(medians[label][part][b]) for b in BATCHES)]
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
            "DraftTrees (only before 2026-12-02), describe = the step's description "
            "(before: tree_rows + publish from the host trees; after: the layout + publish "
            "with the gather from the builder's table, which CUDA replays as one graph).",
        ],
    )
    print(text)


if __name__ == "__main__":
    main()
