"""How tree rows round in bfloat16 next to FlashAttention-3 decoding (CUDA, Hopper).

    python benchmarks/tree_rounding_bench.py --out benchmarks/results/DIR

The bf16 divergence test (tests/gpu/test_bf16_divergence.py) found DominoTree's greedy
output leaving the target's own far more often than vLLM's DFlash. This measures the
suspected cause in isolation: random trees after random contexts in a paged cache
(tests' shapes: Qwen3-4B's and SmolLM2-135M's attention), and every row that a branching
tree's causal pass gets wrong computed these ways:
- decode: FA3 called as vLLM's backend decodes (tree_attention_check.vllm_decode_output:
  the row as a one-token request over its own prefix, ancestors and itself in 16-slot
  pages, max_seqlen_q 1, vLLM's ahead-of-time scheduler metadata): what decoding that
  path without speculation computes, up to FA3's split count (which its scheduler takes
  from the whole batch);
- path_decode: the same rows as the plugin's one-row path requests (one-slot pages,
  max_seqlen_q 17, no metadata): the oracle of the kernel tests before 2026-12-04;
- paths: FA3 over the step's path requests (engine/tree_paths.py,
  DOMINOTREE_CUDA_TREE_ATTENTION=paths); one_pass: the same with every row;
- fixup: the Triton tree kernel in its fast rounding (kernels/tree_attention.py);
- fixup_fa3: the Triton tree kernel in FA3's steps (kernels/tree_attention_fa3.py, the
  fix-up beside FA3), told decode's batch of blocks;
- fa3_reference: those steps in torch (tree_attention_fa3.fa3_decoding_reference): how
  far the model of FA3's steps itself is from FA3 (--fa3-models: and other models, with
  other key blocks or split rules, to say which fact is off when it is far);
- exact: the dense float32 reference.
FA3 is called with vLLM's split bound under FULL graphs (SPLITS_UNDER_GRAPHS), as the
engine's graphs call it (before 2026-12-03e: FA3's own count).
Reported per shape, context and batch: the share of output elements that differ from
decode's, bit for bit, the mean / max absolute error against exact, and the GPU time of
the step's passes per layer (CUDA events, median of repeated launches): the stock FA3 pass
over the real requests (what vLLM's forward runs), the fix-up, and the paths pass (its
tables published beforehand, as the runner does before the forward). The paths pass is
timed with FA3 told the batch's longest sequence (what the runner passes since
2026-12-03) and the model's length (before), each with FA3's own split count and with
vLLM's bound under FULL graphs (SPLITS_UNDER_GRAPHS; FA3 takes a given count as is, and
allocates and combines that many partial outputs per query row), and with one split:
which of them made the H200's path pass cost 4 ms per round at batch 16. Writes
tree_rounding.json / .md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from results_io import command_line, write_results  # benchmarks/ is this script's folder

from vllm_dominotree.kernels.tree_attention import TreeAttention, tree_attention_reference
from vllm_dominotree.kernels.tree_attention_fa3 import fa3_block_n, fa3_decoding_reference

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from tree_attention_check import ATTENTION_SHAPES as SHAPES
from tree_attention_check import (  # the tests' cases
    bf16_case,
    decode_batch_blocks,
    path_tables,
    paths_output,
    vllm_decode_output,
)

ROWS = 17  # budget 16 + the root
MODEL_LENGTH = 40960  # Qwen3-4B's: the paths pass's max_seqlen_k until 2026-12-03
SPLITS_UNDER_GRAPHS = 32  # vLLM's flash_attn_max_num_splits_for_cuda_graph default


def gpu_ms(launch, repeats: int = 30) -> float:
    """Median GPU milliseconds of one launch (CUDA events around each, after a warm-up)."""
    launch()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


# --fa3-models: other models of FA3's decoding steps, the torch model with another key
# block or another split rule, so that a run that finds the kernel apart from FA3 also
# says which fact of the model is off. (name, block_n or None: fa3_block_n, batch
# blocks: 0 the decode step's, 1 a split per block (few blocks per SM), huge one split)
FA3_MODELS = [
    ("block 128", 128, None),
    ("block 160", 160, None),
    ("block 176", 176, None),
    ("block 192", 192, None),
    ("a split per block", None, 1),
    ("one split", None, 10**9),
]


def fa3_model_shares(args, scale: float, decode: torch.Tensor, blocks: int, num_sms: int):
    """Per FA3_MODELS entry, the share of the fixed rows' elements that differ from
    decode."""
    fixed = args[-1].bool()
    shares = {}
    for name, block_n, batch_blocks in FA3_MODELS:
        out = torch.full_like(args[0], 7.0)
        fa3_decoding_reference(
            *args, scale, out, num_sms, block_n=block_n, batch_blocks=batch_blocks or blocks
        )
        shares[name] = float((out[fixed] != decode[fixed]).float().mean())
    return shares


def measure(shape: str, context: int, seed: int, requests: int, fa3_models: bool) -> dict:
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func

    heads, _, head_dim = SHAPES[shape]
    # A case whose trees have rows to fix (two requests can draw a single chain: the H200
    # run of 2026-12-02 stopped on one): the next seeds until one has.
    for attempt in range(100):
        args = bf16_case(shape, seed + 1000 * attempt, context, ROWS, requests=requests)
        if args[-1].any():
            break
    query, needs_fix = args[0], args[-1]
    scale = head_dim**-0.5
    fixed = needs_fix.bool()
    tables = path_tables(args, each_row=False)
    every = path_tables(args, each_row=False, every_row=True)  # one pass: all rows
    splits = SPLITS_UNDER_GRAPHS
    outputs = {
        "decode": vllm_decode_output(args, num_splits=splits),
        "path_decode": paths_output(args, True, ROWS, num_splits=splits),
        "paths": paths_output(args, False, ROWS, tables, num_splits=splits),
        "one_pass": paths_output(args, False, ROWS, every, num_splits=splits, every_row=True),
        "fixup": torch.full_like(query, 7.0),
        "fixup_fa3": torch.full_like(query, 7.0),
        "fa3_reference": torch.full_like(query, 7.0),
    }
    fixup = TreeAttention(heads, head_dim, ROWS, "cuda")
    fixup(*args, scale, outputs["fixup"])
    fixup_fa3 = TreeAttention(heads, head_dim, ROWS, "cuda", rounds_as="fa3")
    blocks = decode_batch_blocks(args, fa3_block_n(head_dim))  # decode's step, as FA3 sees it
    fixup_fa3(*args, scale, outputs["fixup_fa3"], blocks)
    fa3_decoding_reference(
        *args, scale, outputs["fa3_reference"], fixup_fa3.num_sms, batch_blocks=blocks
    )
    query, key_cache, value_cache, block_table, query_start, seq_lens = args[:6]
    stock_out = torch.empty_like(query)
    longest = int(seq_lens.max())

    def stock(num_splits: int = 0):
        flash_attn_varlen_func(
            q=query,
            k=key_cache,
            v=value_cache,
            out=stock_out,
            cu_seqlens_q=query_start,
            max_seqlen_q=ROWS,
            seqused_k=seq_lens,
            max_seqlen_k=longest,
            softmax_scale=scale,
            causal=True,
            block_table=block_table,
            fa_version=3,
            num_splits=num_splits,
        )

    def paths(max_seqlen_k: int, num_splits: int, requests=tables):
        one_pass = requests is every  # written with one pass's single gather
        return gpu_ms(
            lambda: paths_output(args, False, ROWS, requests, max_seqlen_k, num_splits, one_pass)
        )

    timings = {
        "stock_ms": gpu_ms(stock),
        "stock_graph_splits_ms": gpu_ms(lambda: stock(SPLITS_UNDER_GRAPHS)),
        "fixup_ms": gpu_ms(lambda: fixup(*args, scale, outputs["fixup"])),
        "fixup_fa3_ms": gpu_ms(lambda: fixup_fa3(*args, scale, outputs["fixup_fa3"])),
        "paths_ms": paths(longest, 0),
        "paths_graph_splits_ms": paths(longest, SPLITS_UNDER_GRAPHS),
        "paths_one_split_ms": paths(longest, 1),
        "paths_model_length_ms": paths(MODEL_LENGTH, 0),
        "paths_model_length_graph_splits_ms": paths(MODEL_LENGTH, SPLITS_UNDER_GRAPHS),
        # One pass: these replace both the stock pass and the paths (every row).
        "one_pass_graph_splits_ms": paths(longest, SPLITS_UNDER_GRAPHS, every),
        "one_pass_one_split_ms": paths(longest, 1, every),
    }
    exact = torch.zeros(query.shape, dtype=torch.float32, device="cuda")
    tree_attention_reference(query.float(), *args[1:], scale, exact)
    result = {
        "shape": shape,
        "context": context,
        "requests": requests,
        "fixed_rows": int(fixed.sum()),
        **timings,
    }
    if fa3_models:
        result["fa3_models"] = fa3_model_shares(
            args, scale, outputs["decode"], blocks, fixup_fa3.num_sms
        )
    for name, out in outputs.items():
        error = (out[fixed].float() - exact[fixed]).abs()
        result[name] = {
            "differs_from_decode": float((out[fixed] != outputs["decode"][fixed]).float().mean()),
            "mean_abs_error": float(error.mean()),
            "max_abs_error": float(error.max()),
        }
    return result


TIMINGS = (
    "stock_ms",
    "stock_graph_splits_ms",
    "fixup_ms",
    "fixup_fa3_ms",
    "paths_ms",
    "paths_graph_splits_ms",
    "paths_one_split_ms",
    "paths_model_length_ms",
    "paths_model_length_graph_splits_ms",
    "one_pass_graph_splits_ms",
    "one_pass_one_split_ms",
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096])
    parser.add_argument("--requests", type=int, nargs="+", default=[2, 16])
    parser.add_argument(
        "--fa3-models", action="store_true", help="also the torch model under FA3_MODELS"
    )
    args = parser.parse_args()
    cases = [(s, c, r) for s in SHAPES for c in args.contexts for r in args.requests]
    results = [measure(s, c, seed, r, args.fa3_models) for seed, (s, c, r) in enumerate(cases)]
    for r in results:
        if "fa3_models" in r:  # in the log, the JSON keeps them too
            print(r["shape"], r["context"], r["requests"], "FA3 models != decode:", r["fa3_models"])
    methods = ("decode", "path_decode", "paths", "one_pass", "fixup", "fixup_fa3", "fa3_reference")
    rows = [
        [
            r["shape"],
            r["context"],
            r["requests"],
            r["fixed_rows"],
            *(f"{100 * r[m]['differs_from_decode']:.2f}%" for m in methods[1:]),
            *(f"{r[m]['mean_abs_error']:.2e}" for m in methods),
            *(f"{r[k]:.3f}" for k in TIMINGS),
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
                "requests",
                "fixed rows",
                "path decode != decode",
                "paths != decode",
                "one pass != decode",
                "fixup != decode",
                "fixup, FA3's steps != decode",
                "FA3's steps in torch != decode",
                "decode mean |err|",
                "path decode mean |err|",
                "paths mean |err|",
                "one pass mean |err|",
                "fixup mean |err|",
                "fixup, FA3's steps mean |err|",
                "FA3's steps in torch mean |err|",
                "stock FA3 ms",
                f"stock, {SPLITS_UNDER_GRAPHS} splits",
                "fix-up ms",
                "fix-up, FA3's steps ms",
                "paths ms (incl. its query gather and copy)",
                f"paths, {SPLITS_UNDER_GRAPHS} splits",
                "paths, one split",
                "paths, model length",
                f"paths, model length, {SPLITS_UNDER_GRAPHS} splits",
                f"one pass (every row, no stock pass), {SPLITS_UNDER_GRAPHS} splits",
                "one pass, one split",
            ],
            rows,
            [
                f"# bf16 rounding of tree rows ({device})",
                "",
                f"`{command_line()}`: per case that many requests (the first a plain decode "
                f"row), random trees of up to {ROWS} rows after random contexts; over the "
                "rows a causal pass gets wrong, the share of output elements that differ "
                "from FA3's one-token decoding of the row's own path as vLLM calls it "
                "(all FA3 calls with "
                f"{SPLITS_UNDER_GRAPHS} splits, as under FULL graphs), the mean absolute "
                "error against the float32 reference, and GPU ms per layer's pass "
                "(one pass: in place of the stock pass and the paths).",
            ],
        )
    )


if __name__ == "__main__":
    main()
