"""How the tree fix-up kernel rounds in bfloat16 next to FlashAttention-3 (CUDA, Hopper).

    python benchmarks/tree_rounding_bench.py --out benchmarks/results/DIR

The bf16 divergence test (tests/gpu/test_bf16_divergence.py) found DominoTree's greedy
output leaving the target's own far more often than vLLM's DFlash. This measures the
suspected cause in isolation. Per request a chain of `rows` rows after a committed
context, random q / paged K/V, and every row's attention computed four ways:
- decode: FA3 with each row as its own one-token request over its causal prefix (what
  decoding without speculation computes, up to FA3's split heuristics);
- verify: FA3 over the request's rows as one causal query (what DFlash's verification
  and the stock pass of a tree step compute);
- fix-up: kernels/tree_attention.py recomputing every row but the root (the rows a
  branching tree hands it), with the chain's ancestor bits: equal to causal attention in
  exact arithmetic;
- exact: the dense float32 reference.
Reported per shape: the fraction of output elements that differ from decode's (bit for
bit) and the mean / max absolute error against exact. Writes tree_rounding.json / .md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from results_io import command_line, write_results  # benchmarks/ is this script's folder

from vllm_dominotree.kernels.tree_attention import TreeAttention, tree_attention_reference
from vllm_dominotree.tree.ancestry import tree_bits

PAGE = 16
SHAPES = {"qwen3-4b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}  # heads, KV heads, head dim


def fa3(query, key_cache, value_cache, block_table, query_start, seq_lens, scale, max_q):
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    out = torch.empty_like(query)
    flash_attn_varlen_func(
        q=query,
        k=key_cache,
        v=value_cache,
        out=out,
        cu_seqlens_q=query_start,
        max_seqlen_q=max_q,
        seqused_k=seq_lens,
        max_seqlen_k=int(seq_lens.max()),
        softmax_scale=scale,
        causal=True,
        block_table=block_table,
        fa_version=3,
    )
    return out


def measure(shape: str, batch: int, context: int, rows: int, seed: int) -> dict:
    heads, kv_heads, head_dim = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = (context + rows + PAGE - 1) // PAGE
    block_table = torch.arange(batch * pages, dtype=torch.int32, device="cuda").view(batch, pages)

    def randn(*size):
        return torch.randn(*size, generator=gen, device="cuda", dtype=torch.bfloat16)

    key_cache = randn(batch * pages, PAGE, kv_heads, head_dim)
    value_cache = randn(batch * pages, PAGE, kv_heads, head_dim)
    query = randn(batch * rows, heads, head_dim)
    scale = head_dim**-0.5
    seq_len = context + rows
    query_start = torch.arange(0, batch * rows + 1, rows, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")

    verify = fa3(query, key_cache, value_cache, block_table, query_start, seq_lens, scale, rows)
    # decode: row j of request r is a request of its own with seq_len - rows + j + 1 keys.
    per_row_lens = (context + 1 + torch.arange(rows, device="cuda")).repeat(batch).int()
    per_row_tables = block_table.repeat_interleave(rows, dim=0).contiguous()
    one_each = torch.arange(batch * rows + 1, dtype=torch.int32, device="cuda")
    decode = fa3(query, key_cache, value_cache, per_row_tables, one_each, per_row_lens, scale, 1)

    parents = np.array([[-1, *range(rows - 1)]])  # a chain
    ancestors, _, _ = tree_bits(parents)
    meta = (
        block_table,
        query_start,
        seq_lens,
        torch.from_numpy(np.tile(ancestors[0], batch)).cuda(),
        torch.from_numpy(np.tile([0, *[1] * (rows - 1)], batch).astype(np.int64)).cuda(),
    )
    fixup = verify.clone()
    TreeAttention(heads, head_dim, rows, "cuda")(query, key_cache, value_cache, *meta, scale, fixup)
    exact = torch.zeros(query.shape, dtype=torch.float32, device="cuda")
    everything = (*meta[:-1], torch.ones_like(meta[-1]))
    tree_attention_reference(query.float(), key_cache, value_cache, *everything, scale, exact)

    fixed = torch.arange(batch * rows, device="cuda") % rows != 0  # the rows the kernel wrote
    result = {"shape": shape, "batch": batch, "context": context, "rows": rows}
    for name, out in (("decode", decode), ("verify", verify), ("fixup", fixup)):
        got, want = out[fixed].float(), exact[fixed]
        result[name] = {
            "differs_from_decode": float((out[fixed] != decode[fixed]).float().mean()),
            "mean_abs_error": float((got - want).abs().mean()),
            "max_abs_error": float((got - want).abs().max()),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rows", type=int, default=16)
    args = parser.parse_args()
    results = [
        measure(shape, args.batch, context, args.rows, seed)
        for seed, (shape, context) in enumerate((s, c) for s in SHAPES for c in args.contexts)
    ]
    rows = [
        [
            r["shape"],
            r["context"],
            *(f"{100 * r[m]['differs_from_decode']:.2f}%" for m in ("verify", "fixup")),
            *(f"{r[m]['mean_abs_error']:.2e}" for m in ("decode", "verify", "fixup")),
        ]
        for r in results
    ]
    print(
        write_results(
            args.out,
            "tree_rounding",
            {"command": command_line(), "device": torch.cuda.get_device_name(), "results": results},
            [
                "shape",
                "context",
                "verify != decode",
                "fix-up != decode",
                "decode mean |err|",
                "verify mean |err|",
                "fix-up mean |err|",
            ],
            rows,
            [
                f"# bf16 rounding of tree rows ({torch.cuda.get_device_name()})",
                "",
                f"`{command_line()}`: batch {args.batch}, a chain of {args.rows} rows per "
                "request (every row but the root through the fix-up kernel), random q and "
                "paged K/V; output elements that differ from FA3's one-row decode, and the "
                "mean absolute error against the float32 reference.",
            ],
        )
    )


if __name__ == "__main__":
    main()
