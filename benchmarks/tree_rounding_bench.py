"""How tree rows round in bfloat16 next to FlashAttention-3 decoding (CUDA, Hopper).

    python benchmarks/tree_rounding_bench.py --out benchmarks/results/DIR

The bf16 divergence test (tests/gpu/test_bf16_divergence.py) found DominoTree's greedy
output leaving the target's own far more often than vLLM's DFlash. This measures the
suspected cause in isolation: random trees after random contexts in a paged cache
(tests' shapes: Qwen3-4B's and SmolLM2-135M's attention), and every row that a branching
tree's causal pass gets wrong computed four ways:
- decode: FA3 with the row as a one-token request whose keys are its own prefix,
  ancestors and itself (pages of one slot): what decoding that path without speculation
  computes, up to FA3's split heuristics;
- paths: FA3 over the step's path requests (engine/tree_paths.py,
  DOMINOTREE_CUDA_TREE_ATTENTION=paths);
- fixup: the Triton tree kernel (kernels/tree_attention.py, the default);
- exact: the dense float32 reference.
Reported per shape and context: the share of output elements that differ from decode's,
bit for bit, and the mean / max absolute error against exact. Writes tree_rounding.json /
.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from results_io import command_line, write_results  # benchmarks/ is this script's folder

from vllm_dominotree.kernels.tree_attention import TreeAttention, tree_attention_reference

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from tree_attention_check import paths_output, random_case  # the kernel tests' cases

SHAPES = {"qwen3-4b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}  # heads, KV heads, head dim
ROWS = 17  # budget 16 + the root


def measure(shape: str, context: int, seed: int, requests: int) -> dict:
    heads, kv_heads, head_dim = SHAPES[shape]
    args = random_case(
        "cuda",
        torch.bfloat16,
        seed,
        requests=requests,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        max_context=context,
        max_rows=ROWS,
    )
    query, needs_fix = args[0], args[-1]
    scale = head_dim**-0.5
    fixed = needs_fix.bool()
    outputs = {
        "decode": paths_output(args, each_row=True, max_rows=ROWS),
        "paths": paths_output(args, each_row=False, max_rows=ROWS),
        "fixup": torch.full_like(query, 7.0),
    }
    TreeAttention(heads, head_dim, ROWS, "cuda")(*args, scale, outputs["fixup"])
    exact = torch.zeros(query.shape, dtype=torch.float32, device="cuda")
    tree_attention_reference(query.float(), *args[1:], scale, exact)
    result = {"shape": shape, "context": context, "fixed_rows": int(fixed.sum())}
    for name, out in outputs.items():
        error = (out[fixed].float() - exact[fixed]).abs()
        result[name] = {
            "differs_from_decode": float((out[fixed] != outputs["decode"][fixed]).float().mean()),
            "mean_abs_error": float(error.mean()),
            "max_abs_error": float(error.max()),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096])
    parser.add_argument("--requests", type=int, default=8)
    args = parser.parse_args()
    cases = [(s, c) for s in SHAPES for c in args.contexts]
    results = [measure(s, c, seed, args.requests) for seed, (s, c) in enumerate(cases)]
    methods = ("decode", "paths", "fixup")
    rows = [
        [
            r["shape"],
            r["context"],
            r["fixed_rows"],
            *(f"{100 * r[m]['differs_from_decode']:.2f}%" for m in methods[1:]),
            *(f"{r[m]['mean_abs_error']:.2e}" for m in methods),
        ]
        for r in results
    ]
    device = torch.cuda.get_device_name()
    print(
        write_results(
            args.out,
            "tree_rounding",
            {"command": command_line(), "device": device, "results": results},
            [
                "shape",
                "max context",
                "fixed rows",
                "paths != decode",
                "fixup != decode",
                "decode mean |err|",
                "paths mean |err|",
                "fixup mean |err|",
            ],
            rows,
            [
                f"# bf16 rounding of tree rows ({device})",
                "",
                f"`{command_line()}`: {args.requests} requests per case with random trees "
                f"of up to {ROWS} rows after random contexts; over the rows a causal pass "
                "gets wrong, the share of output elements that differ from FA3's one-token "
                "decoding of the row's own path, and the mean absolute error against the "
                "float32 reference.",
            ],
        )
    )


if __name__ == "__main__":
    main()
