"""vLLM engine on CPU with the toy pair: no speculation vs chain / marginal / conditional.

    python benchmarks/cpu_engine_bench.py --out benchmarks/results

For each method one engine (float32, eager) decodes the same prompts greedily, once as
a batch and once one request at a time; reported: decode tokens/s, the mean accept
length (tokens committed per verification, bonus included) from vLLM's spec-decode
counters, and whether the output equals the no-speculation engine's. Writes
cpu_engine_bench.json and cpu_engine_bench.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from harness import spec_counters  # benchmarks/ is this script's folder
from results_io import command_line, write_results

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

METHODS = {
    "no-spec": None,
    "chain": {"scorer": "chain"},
    "marginal": {"scorer": "marginal"},
    "conditional": {"scorer": "conditional"},
    "conditional-b32": {"scorer": "conditional", "budget": 32},
}


def prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 63 for j in range(4 + 5 * i)] for i in range(n)]


def run_method(name, options, dirs, args):
    from vllm import LLM, SamplingParams

    spec = None if options is None else {"method": "dominotree", "model": dirs[1], **options}
    llm = LLM(
        model=str(dirs[0]),
        dtype="float32",
        max_model_len=1024,
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,
        speculative_config=spec,
    )
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts(args.prompts)]
    llm.generate(batch[:2], params, use_tqdm=False)  # warm-up
    before = spec_counters(llm)
    row = {"method": name}
    outputs = None
    for mode, groups in (("batch", [batch]), ("single", [[p] for p in batch])):
        start = time.perf_counter()
        done = [llm.generate(g, params, use_tqdm=False) for g in groups]
        seconds = time.perf_counter() - start
        result = [list(o.outputs[0].token_ids) for group in done for o in group]
        outputs = outputs or result
        assert result == outputs, f"{name}: batch and single outputs differ"
        row[f"{mode}_tok_s"] = sum(map(len, result)) / seconds
    drafts, accepted = (now - then for now, then in zip(spec_counters(llm), before, strict=True))
    row["accept_length"] = 1 + accepted / drafts if drafts else 1.0
    if spec is not None:
        row["tree_stats"] = llm.collective_rpc("dominotree_stats")[0]
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return row, outputs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--noise", type=float, default=0.8)
    args = parser.parse_args()

    from vllm_dominotree.demo.toy_pair import PairSpec, write_pair

    with tempfile.TemporaryDirectory() as tmp:
        dirs = write_pair(tmp, PairSpec(noise=args.noise))
        rows, reference = [], None
        for name, options in METHODS.items():
            row, outputs = run_method(name, options, dirs, args)
            reference = reference or outputs
            row["equals_no_spec"] = outputs == reference
            rows.append(row)
            print(json.dumps(row), flush=True)
    base = rows[0]
    for row in rows:
        row["batch_speedup"] = row["batch_tok_s"] / base["batch_tok_s"]
        row["single_speedup"] = row["single_tok_s"] / base["single_tok_s"]
    meta = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "pair": f"toy pair (PairSpec(noise={args.noise})), float32",
        "command": command_line(),
    }
    intro = [
        f"# vLLM CPU engine, toy pair ({meta['machine']})",
        "",
        f"`{meta['command']}`: {args.prompts} prompts, {args.max_tokens} greedy tokens each;",
        "batch = all prompts in one generate call, single = one request at a time.",
    ]
    header = [
        "method",
        "accept length",
        "batch tok/s",
        "speedup",
        "single tok/s",
        "speedup",
        "== no-spec",
    ]
    table = [
        [
            r["method"],
            f"{r['accept_length']:.2f}",
            f"{r['batch_tok_s']:.0f}",
            f"{r['batch_speedup']:.2f}x",
            f"{r['single_tok_s']:.0f}",
            f"{r['single_speedup']:.2f}x",
            r["equals_no_spec"],
        ]
        for r in rows
    ]
    write_results(args.out, "cpu_engine_bench", {"meta": meta, "rows": rows}, header, table, intro)


if __name__ == "__main__":
    main()
