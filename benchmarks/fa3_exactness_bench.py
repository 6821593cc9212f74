"""Is the FA3-rounded fix-up bit-exact to FA3's decoding? Which of its readings of FA3's
arithmetic make it so (CUDA, Hopper).

    python benchmarks/fa3_exactness_bench.py --out benchmarks/results/DIR

The fix-up (kernels/tree_attention_fa3.py) takes FA3's steps for each tree row; in the
SmolLM2 engine its rows (before FA3's order) left the target's greedy output on 63-67
of 100 prompts (2026-12-04) while 0-0.036% of their elements differed from FA3's
decoding call in the kernel tests: every difference flips some bf16 near-tie, so it must
be exact. What FA3's
code leaves to its compiler (nvcc --use_fast_math) is read here in variants, each the
kernel with:
- math 1: exp2 as ex2.approx.ftz, `1.f / sum` as rcp.approx.ftz, __logf / __expf as
  lg2 / ex2.approx.ftz in float32; math 2: the same with `1.f / sum` as div.full.ftz;
  math 0: Triton's exp2 and IEEE division;
- thread sums: row sums in FA3's per-thread order (each quad lane's columns one by one,
  the four lanes added at the end), or tl.sum's tree;
- warps per program: 8 (the kernel's), 4 or 16 (ptxas spills 0.7 / 4.9 / 1.4 KB per
  thread at head dim 128: which is fastest, and do the rows stay exact).
Every variant adds P @ V into the rescaled accumulator in 16-key chunks with the tree's
keys in their decoding chunks (FA3's MMA order).
Against FA3 called as vLLM's backend decodes (tree_attention_check.vllm_decode_output),
with vLLM's split bound under FULL graphs (the kernel told that call's key blocks) and
with one split (FA3 given num_splits 1, the kernel a step too large to split), on the
tests' random trees (tests/tree_attention_check.random_case: 4 requests, up to 17 rows)
at several contexts, both shapes. Reports per variant the share of the fixed rows'
output elements that differ, how many cases are exact, and the GPU time of a launch (CUDA
events, median of repeated launches, then the mean over the cases). On the H200
(2026-12-04c) math 1 and 2 with thread sums were exact in every case. Writes
fa3_exactness.json / .md.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch
from results_io import command_line, write_results  # benchmarks/ is this script's folder
from tree_rounding_bench import gpu_ms

from vllm_dominotree.kernels.tree_attention import TreeAttention
from vllm_dominotree.kernels.tree_attention_fa3 import fa3_block_n

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from tree_attention_check import ATTENTION_SHAPES as SHAPES
from tree_attention_check import bf16_case, decode_batch_blocks, vllm_decode_output

VARIANTS = {  # name: (math, thread sums, warps)
    "math1+thread-sums": (1, True, 8),
    "math2+thread-sums": (2, True, 8),
    "math1+tl.sum": (1, False, 8),
    "math0+thread-sums": (0, True, 8),
    "math1+thread-sums+4-warps": (1, True, 4),
    "math1+thread-sums+16-warps": (1, True, 16),
}
UNSPLIT_BLOCKS = 10**7  # a decoding step so large that FA3's rule gives every row one split


def measure(shape: str, contexts: list[int], seeds: int, variants: list[str]) -> list[dict]:
    heads, _, head_dim = SHAPES[shape]
    kernels = {}
    for name in variants:
        kernel = TreeAttention(heads, head_dim, 17, torch.device("cuda"), rounds_as="fa3")
        kernel.fa3_math, kernel.fa3_thread_sums, kernel.fa3_warps = VARIANTS[name]
        kernels[name] = kernel
    found = []
    for context in contexts:
        for seed in range(seeds):
            args = bf16_case(shape, seed, context)
            fixed = args[-1].bool()
            modes = {
                "vLLM's splits": (
                    vllm_decode_output(args),
                    decode_batch_blocks(args, fa3_block_n(head_dim)),
                ),
                "one split": (vllm_decode_output(args, num_splits=1), UNSPLIT_BLOCKS),
            }
            for mode, (decode, blocks) in modes.items():
                for name, kernel in kernels.items():
                    got = torch.full_like(args[0], 7.0)
                    launch = partial(kernel, *args, head_dim**-0.5, got, blocks)
                    launch()
                    share = (got[fixed] != decode[fixed]).float().mean().item()
                    micros = 1000 * gpu_ms(launch)
                    found.append(
                        dict(
                            shape=shape,
                            context=context,
                            seed=seed,
                            mode=mode,
                            variant=name,
                            share=share,
                            gpu_us=micros,
                        )
                    )
                    print(
                        shape, context, seed, mode, name, f"{share:.6f} {micros:.1f} us", flush=True
                    )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--contexts", type=int, nargs="+", default=[100, 300, 1100, 3000])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    args = parser.parse_args()
    found: list[dict] = []
    for shape in args.shapes:  # results written after each shape: a cut call keeps them
        found += measure(shape, args.contexts, args.seeds, args.variants)
        rows = []
        for key in dict.fromkeys(
            (f["shape"], f["context"], f["mode"], f["variant"]) for f in found
        ):
            cases = [f for f in found if (f["shape"], f["context"], f["mode"], f["variant"]) == key]
            shares = [f["share"] for f in cases]
            rows.append(
                [
                    *key,
                    f"{100 * sum(shares) / len(shares):.4f}%",
                    f"{shares.count(0.0)} of {len(shares)}",
                    f"{sum(f['gpu_us'] for f in cases) / len(cases):.1f}",
                ]
            )
        write_results(
            args.out,
            "fa3_exactness",
            dict(command=command_line(), device=torch.cuda.get_device_name(), cases=found),
            [
                "shape",
                "max context",
                "FA3 splits",
                "variant",
                "elements differing (mean)",
                "exact cases",
                "GPU us per launch (mean of medians)",
            ],
            rows,
            intro=[
                f"# FA3-rounded fix-up against FA3's decoding ({torch.cuda.get_device_name()})",
                "",
                f"`{command_line()}`: bf16, the tests' random trees; the share of the fixed rows'",
                "output elements that differ from FA3 called as vLLM's backend decodes.",
            ],
        )


if __name__ == "__main__":
    main()
