"""vLLM engine on CPU: no speculation vs chain / marginal / conditional trees.

    python benchmarks/cpu_engine_bench.py --out benchmarks/results \
        [--pair toy|smollm2] [--dtype float32|bfloat16] [--methods no-spec conditional ...]

For each method one engine (eager) decodes the same prompts greedily, once as a batch
and once one request at a time; reported: decode tokens/s, the mean accept length
(tokens committed per verification, bonus included) from vLLM's spec-decode counters,
whether the output equals the no-speculation engine's (in bfloat16 it need not), and
the plugin's stage clock per mode: ms per verification step in verify (the target's
forward with the tree attention), draft, build and accept, and the whole step (for no
speculation: the ms of a decode step, from its tokens per second). Pairs: the toy pair
(toy_pair.py; prompts of random ids) or SmolLM2-135M-Instruct with its shipped drafter
(the demo's chat prompts). `--repeats N` times each mode N times (tokens/s from the
median run, every run kept). Writes NAME.json and NAME.md (NAME: --name).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from harness import spec_counters  # benchmarks/ is this script's folder
from results_io import command_line, write_results

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# Budgets left out: the CPU default (config.CPU_BUDGET).
METHODS = {
    "no-spec": None,
    "chain": {"scorer": "chain"},
    "marginal": {"scorer": "marginal"},
    "conditional": {"scorer": "conditional"},
    **{f"conditional-b{b}": {"scorer": "conditional", "budget": b} for b in (2, 8, 16, 32)},
    # A step's trees share N nodes (config step_nodes), 0: no limit.
    **{f"conditional-n{n}": {"scorer": "conditional", "step_nodes": n} for n in (0, 4, 6, 8)},
}
DEFAULT_METHODS = ["no-spec", "chain", "marginal", "conditional", "conditional-b32"]
STAGES = ("verify", "draft", "build", "accept", "step")


def stage_clock(llm) -> tuple[int, dict[str, float]]:
    """The plugin's verification steps and stage seconds so far."""
    stats = llm.collective_rpc("dominotree_stats")[0]
    return stats["steps"], dict(stats["stage_seconds"])


def toy_prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 63 for j in range(4 + 5 * i)] for i in range(n)]


def run_method(name, options, dirs, prompts, args):
    from vllm import LLM, SamplingParams

    spec = None if options is None else {"method": "dominotree", "model": str(dirs[1]), **options}
    llm = LLM(
        model=str(dirs[0]),
        dtype=args.dtype,
        max_model_len=1024,
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,
        speculative_config=spec,
    )
    params = SamplingParams(
        temperature=0,
        max_tokens=args.max_tokens,
        ignore_eos=True,
        logprobs=args.logprobs,
        repetition_penalty=args.repetition_penalty,
    )
    batch = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(batch[:2], params, use_tqdm=False)  # warm-up
    if spec is not None:
        llm.collective_rpc("dominotree_profile", args=(True,))
    before = spec_counters(llm)
    row = {"method": name}
    outputs = None
    for mode, groups in (("batch", [batch]), ("single", [[p] for p in batch])):
        clock = stage_clock(llm) if spec is not None else None
        runs = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            done = [llm.generate(g, params, use_tqdm=False) for g in groups]
            runs.append(time.perf_counter() - start)
        row[f"{mode}_runs_s"] = runs
        seconds = statistics.median(runs)
        result = [list(o.outputs[0].token_ids) for group in done for o in group]
        if outputs is None and args.logprobs is not None:  # each token's own logprob
            row["logprobs"] = [
                [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)]
                for group in done
                for c in (o.outputs[0] for o in group)
            ]
        outputs = outputs or result
        # float32 output does not depend on the batch; bfloat16 output may (no check).
        assert args.dtype != "float32" or result == outputs, f"{name}: batch != single"
        row[f"{mode}_tok_s"] = sum(map(len, result)) / seconds
        if clock is None:  # a decode step makes one token per running request
            running = len(batch) if mode == "batch" else 1
            row[f"{mode}_stage_ms"] = {"step": 1e3 * running / row[f"{mode}_tok_s"]}
        else:
            (steps, start_s), (steps_after, end_s) = clock, stage_clock(llm)
            row[f"{mode}_stage_ms"] = {
                s: 1e3 * (end_s.get(s, 0.0) - start_s.get(s, 0.0)) / max(1, steps_after - steps)
                for s in STAGES
            }
    drafts, accepted = (now - then for now, then in zip(spec_counters(llm), before, strict=True))
    row["accept_length"] = 1 + accepted / drafts if drafts else 1.0
    if spec is not None:
        stats = llm.collective_rpc("dominotree_stats")[0]
        row["tree_stats"] = stats
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return row, outputs


def pair_and_prompts(args, tmp: str) -> tuple[tuple[Path, Path], list[list[int]], str]:
    """(target dir, drafter dir), the prompts' token ids, and the pair in words (the toy
    pair written under tmp)."""
    if args.pair == "toy":
        from vllm_dominotree.demo.toy_pair import PairSpec, write_pair

        dirs = write_pair(tmp, PairSpec(noise=args.noise))
        return dirs, toy_prompts(args.prompts), f"toy pair (PairSpec(noise={args.noise}))"
    from transformers import AutoTokenizer

    from vllm_dominotree.demo.__main__ import prompt_ids
    from vllm_dominotree.training.smollm2 import DRAFTER_DIR
    from vllm_dominotree.training.smollm2 import convert as convert_smollm2

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm-dominotree"
    target = convert_smollm2(cache / "smollm2-135m")
    prompts = prompt_ids(AutoTokenizer.from_pretrained(target), "smollm2")
    return (target, DRAFTER_DIR), prompts, "SmolLM2-135M-Instruct + its shipped drafter"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--name", default="cpu_engine_bench")
    parser.add_argument("--pair", choices=["toy", "smollm2"], default="toy")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=DEFAULT_METHODS)
    parser.add_argument("--prompts", type=int, default=8, help="toy pair: how many")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--noise", type=float, default=0.8)
    parser.add_argument("--logprobs", type=int, default=None, help="per request (vLLM's)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per mode (median)")
    args = parser.parse_args()
    if args.methods[0] != "no-spec":
        parser.error("--methods starts with no-spec: the speedups are over it")

    with tempfile.TemporaryDirectory() as tmp:
        dirs, prompts, pair = pair_and_prompts(args, tmp)
        rows, reference = [], None
        for name in args.methods:
            row, outputs = run_method(name, METHODS[name], dirs, prompts, args)
            reference = reference or outputs
            row["equals_no_spec"] = outputs == reference
            if "logprobs" in row and row["equals_no_spec"]:
                base = rows[0]["logprobs"] if rows else row["logprobs"]
                pairs = zip(row["logprobs"], base, strict=True)
                row["logprob_max_diff"] = max(
                    abs(a - b) for ours, theirs in pairs for a, b in zip(ours, theirs, strict=True)
                )
            rows.append(row)
            print(json.dumps(row), flush=True)
    base = rows[0]
    for row in rows:
        row["batch_speedup"] = row["batch_tok_s"] / base["batch_tok_s"]
        row["single_speedup"] = row["single_tok_s"] / base["single_tok_s"]
    meta = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "pair": f"{pair}, {args.dtype}",
        "repeats": args.repeats,
        "command": command_line(),
    }
    intro = [
        f"# vLLM CPU engine, {meta['pair']} ({meta['machine']})",
        "",
        f"`{meta['command']}`: {len(prompts)} prompts, {args.max_tokens} greedy tokens each"
        f" (logprobs {args.logprobs}, repetition penalty {args.repetition_penalty});",
        f"each mode timed {args.repeats} time(s), tokens/s from the median run;",
        "batch = all prompts in one generate call, single = one request at a time; ms per",
        f"step ({' / '.join(STAGES)}) from the plugin's stage clock, per mode (no-spec: the",
        "step's ms from its tokens per second).",
    ]
    header = ["method", "accept length", "batch tok/s", "speedup", "single tok/s", "speedup"]
    header += [f"batch ms: {' / '.join(STAGES)}", "single ms: same", "== no-spec"]
    header += ["logprobs max abs diff"]
    table = [
        [
            r["method"],
            f"{r['accept_length']:.2f}",
            f"{r['batch_tok_s']:.0f}",
            f"{r['batch_speedup']:.2f}x",
            f"{r['single_tok_s']:.0f}",
            f"{r['single_speedup']:.2f}x",
            *(
                " / ".join(
                    f"{r[f'{mode}_stage_ms'][s]:.1f}" for s in STAGES if s in r[f"{mode}_stage_ms"]
                )
                for mode in ("batch", "single")
            ),
            r["equals_no_spec"],
            f"{r['logprob_max_diff']:.1e}" if "logprob_max_diff" in r else "-",
        ]
        for r in rows
    ]
    write_results(args.out, args.name, {"meta": meta, "rows": rows}, header, table, intro)


if __name__ == "__main__":
    main()
