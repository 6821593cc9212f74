"""Tree build time per round: the device builder (one captured graph) vs the host heap.

    python benchmarks/builder_bench.py --out benchmarks/results [--device cuda]

Random Domino head of the released Qwen3-4B b16 shapes (hidden 2560, vocab 151936,
GRU 1024, rank 256, 16 drafts), random drafter outputs, conditional scorer (`--scorers
conditional chain`: also Domino's chain, one child per node, as the engine builds it;
its budgets at most the 16 drafts, e.g. `--budgets 15`; `--max-leaves 4 8`: trees of at
most that many leaves, the config's max_leaves, 0 none). A round's
build time is prepare (per-depth top-M, gathers) + the build until every tree is full and
back on the host, measured with device syncs. Per configuration it also checks that the
device builder's trees are the host heap's (tokens, parents, float64 scores).
`--steps torch triton` measures both of the scorer's per-node steps (the compiled torch
step, kernels/domino_step.py's launches) in one run; for the Triton step,
`--gru-programs 256 512` the GRU launch's reduction split for that many programs
(domino_step.GRU_PROGRAMS: more, shorter programs at small batches) and `--table-rows 0 2`
the padded batches that take the GRU's input products from the candidates' table
(domino_step.TABLE_ROWS; 0: none), each set for its measurement.
`--profile` (CUDA) also lists the device build's kernels per build, calls and GPU
microseconds, the largest first (which kernels a build's time is: the GRU's products or
the small ones between them). Writes builder_bench.json and builder_bench.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from results_io import command_line, write_results  # benchmarks/ is this script's folder

from vllm_dominotree.config import DominoTreeConfig
from vllm_dominotree.demo.toy_pair import random_domino_head
from vllm_dominotree.engine.profiling import kernels_by_stage
from vllm_dominotree.stage_clock import LABEL_PREFIX
from vllm_dominotree.tree import DeviceTreeBuilder, build_trees, make_scorer

HIDDEN, VOCAB, GRU, RANK, K = 2560, 151936, 1024, 256, 16
BUILDERS = ("device", "host heap")

# Every configuration compiles its own builder; the default limit of 8 would leave the
# later ones eager.
torch._dynamo.config.recompile_limit = 1024


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def build_kernels(builder, scorer, inputs, builds: int = 10) -> list[dict]:
    """The device builder's kernels per build (CUDA): [{"kernel", "calls", "us"}], the
    largest GPU time first, over `builds` replays of one prepared step."""
    from torch.profiler import ProfilerActivity, profile, record_function

    hidden, base, anchors = inputs[0]
    scorer.prepare(hidden, base)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(builds):
            with record_function(LABEL_PREFIX + "build"):
                builder.launch(anchors)
        torch.cuda.synchronize()
    kernels = kernels_by_stage(prof.events(), top=30)[1].get("build", [])
    if not kernels:
        raise SystemExit("the profiler saw no kernel of the build")
    return [
        {"kernel": k["kernel"], "calls": k["calls"] / builds, "us": 1e3 * k["ms"] / builds}
        for k in kernels
    ]


def measure_with(knobs: dict, *args) -> dict:
    """measure(*args) with domino_step's constants `knobs` (None: the module's value) set
    for it and put back after; the rows say which values ran."""
    from vllm_dominotree.kernels import domino_step

    kept = {name: getattr(domino_step, name, None) for name in knobs}
    try:
        for name, value in knobs.items():
            if value is not None:
                setattr(domino_step, name, value)
        ran = {name: getattr(domino_step, name, None) for name in knobs}
        stats = measure(*args)
    finally:
        for name, value in kept.items():
            setattr(domino_step, name, value)
    for row in stats.values():
        row["knobs"] = ran
    return stats


def measure(head, embed, device, batch, budget, candidates, rounds, inputs, step, profile,
            kind, max_leaves):  # fmt: skip
    """Both builders on the same inputs, for the scorer `kind` ("conditional" or "chain")
    with its `step` ("torch" or "triton") and at most `max_leaves` leaves per tree (0: no
    limit) -> {builder: stats}, trees equal (the device builder's kernels with `profile`)."""
    chain = kind == "chain"
    # The shape the engine builds for these options (a chain: a path of `budget` drafts).
    options = DominoTreeConfig(
        budget=budget, candidates=candidates, scorer=kind, max_leaves=max_leaves
    )
    shape = options.tree_shape(num_drafts=K)
    # The drafter's rows of the depths the shape reaches, as the engine hands them over.
    inputs = [(h[:, : shape.max_depth], b[:, : shape.max_depth], a) for h, b, a in inputs]
    scorer = make_scorer(
        kind,
        head,
        embed,
        shape=shape,
        candidates=candidates,
        prefix_len=1,
        max_requests=batch,
        # (packages before the Triton step know only the torch step, and no `kernels`)
        **({"kernels": True} if step == "triton" else {}),
    )
    assert getattr(scorer, "step", "torch") == step
    builder = DeviceTreeBuilder(scorer, shape, chain=chain, max_requests=batch, device=device)
    if device.type == "cuda":
        builder.capture()
    build = {
        "device": builder.build,
        "host heap": lambda anchors: build_trees(scorer, anchors.tolist(), shape),
    }
    stats, trees = {}, {}
    for name in BUILDERS:
        times, prepare_times, trees[name] = [], [], []
        for i in range(rounds + 3):  # 3 warm-up rounds
            hidden, base, anchors = inputs[i % len(inputs)]
            sync(device)
            t0 = time.perf_counter()
            scorer.prepare(hidden, base)
            sync(device)
            t1 = time.perf_counter()
            built = build[name](anchors)
            t2 = time.perf_counter()  # both builders end on a host read: already synced
            if i >= 3:
                times.append(t2 - t0)
                prepare_times.append(t1 - t0)
            if i < len(inputs):
                trees[name].append([(t.tokens, t.parents, t.scores) for t in built])
        stats[name] = {
            "build_ms_median": 1e3 * statistics.median(times),
            "build_ms_p90": 1e3 * sorted(times)[int(0.9 * len(times))],
            "prepare_ms_median": 1e3 * statistics.median(prepare_times),
            "step": step,
            "scorer": kind,
            # What the device builder was built as: the chain's unrolled path or the heap.
            "tree_shape": [shape.budget, shape.max_depth, shape.max_children],
            "max_leaves": shape.max_leaves,
            "builds_a_path": builder.chain,
        }
    if trees["device"] != trees["host heap"]:
        raise SystemExit(
            f"device trees differ from the host heap's: {kind}, batch {batch}, "
            f"budget {budget}, M {candidates}, max_leaves {max_leaves}"
        )
    if device.type == "cuda" and builder.counts.eager_builds:
        raise SystemExit("the device builder ran outside its CUDA graphs")
    if profile:
        stats["device"]["kernels"] = build_kernels(builder, scorer, inputs)
    return stats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 64])
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--candidates", type=int, nargs="+", default=[32, 64, 128])
    # the scorer's per-node step: the compiled torch step, the Triton launches (CUDA)
    parser.add_argument("--steps", nargs="+", default=["torch"], choices=["torch", "triton"])
    parser.add_argument("--gru-programs", type=int, nargs="+", default=[None])
    parser.add_argument("--table-rows", type=int, nargs="+", default=[None])
    parser.add_argument("--profile", action="store_true", help="the build's kernels (CUDA)")
    parser.add_argument(
        "--scorers", nargs="+", default=["conditional"], choices=["conditional", "chain"]
    )
    # at most this many leaves per tree (the config's max_leaves; 0: no limit)
    parser.add_argument("--max-leaves", type=int, nargs="+", default=[0])
    args = parser.parse_args()
    if "chain" in args.scorers and max(args.budgets) > K:
        parser.error(f"a chain drafts at most the drafter's {K} slots: --budgets <= {K}")
    device = torch.device(args.device)
    if args.profile and device.type != "cuda":
        parser.error("--profile lists GPU kernels: it needs --device cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
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
            anchors = torch.randint(0, VOCAB, (batch,), device=device)
            inputs.append((hidden, base, anchors))
        for budget in args.budgets:
            knobs = [
                {"GRU_PROGRAMS": g, "TABLE_ROWS": t}
                for g, t in itertools.product(args.gru_programs, args.table_rows)
            ]
            steps = [(s, k) for s in args.steps for k in (knobs if s == "triton" else [{}])]
            for kind, m, (step, knob), leaves in itertools.product(
                args.scorers, args.candidates, steps, args.max_leaves
            ):
                stats = measure_with(
                    knob, head, embed, device, batch, budget, m, args.rounds, inputs, step,
                    args.profile, kind, leaves,
                )  # fmt: skip
                for name in BUILDERS:
                    row = {
                        "batch": batch,
                        "budget": budget,
                        "candidates": m,
                        "builder": name,
                        **stats[name],
                        "trees_equal_host_heap": True,
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    meta = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.machine(),
        "torch": torch.__version__,
        "dtype": str(dtype),
        "shapes": {"hidden": HIDDEN, "vocab": VOCAB, "gru": GRU, "rank": RANK, "drafts": K},
        "rounds": args.rounds,
        "command": command_line(),
    }
    intro = [
        f"# Tree build time per round ({meta['device']}, {meta['dtype']}, torch {meta['torch']})",
        "",
        f"`{meta['command']}`; median of {args.rounds} rounds after 3 warm-up rounds, ms per",
        "round. build = prepare (per-depth top-M and gathers) + the build, trees on the host.",
    ]
    header = [
        "scorer",
        "batch",
        "budget",
        "M",
        "max leaves",
        "builder",
        "node step",
        "GRU programs, table rows",
        "build ms (median)",
        "p90",
        "prepare ms",
        "trees == host heap",
    ]
    table = [
        [
            r["scorer"],
            r["batch"],
            r["budget"],
            r["candidates"],
            r["max_leaves"] or "-",
            r["builder"],
            r["step"],
            ", ".join(str(v) for v in r["knobs"].values() if v is not None) or "-",
            f"{r['build_ms_median']:.3f}",
            f"{r['build_ms_p90']:.3f}",
            f"{r['prepare_ms_median']:.3f}",
            r["trees_equal_host_heap"],
        ]
        for r in rows
    ]
    outro = []
    for r in rows:
        if "kernels" in r:
            outro += [
                "",
                f"Kernels per build: {r['scorer']}, batch {r['batch']}, budget {r['budget']}, M "
                f"{r['candidates']}, {r['step']} step (calls, GPU us):",
                "",
                *(f"- {k['calls']:g} x `{k['kernel'][:90]}`: {k['us']:.1f}" for k in r["kernels"]),
            ]
    write_results(
        args.out, "builder_bench", {"meta": meta, "rows": rows}, header, table, intro, outro
    )


if __name__ == "__main__":
    main()
