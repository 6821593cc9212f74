"""CPU tree attention per layer: vLLM's own kernel for 1 and 1 + N rows against the
plugin's recompute of a tree's rows (engine/cpu_attention.py: the same kernel over path
requests on a scratch copy of the blocks), SmolLM2-135M's geometry.

    python benchmarks/cpu_tree_attention_bench.py --out benchmarks/results/cpu_tree_attention \
        [--layout vec-float32|amx-bfloat16] [--name NAME]

A verification layer costs the stock kernel over all 1 + N rows plus the recompute of
the rows a branching tree changes; a plain decode layer costs the kernel over 1 row.
Writes NAME.json and NAME.md (default NAME: cpu_tree_attention_bench).
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from results_io import command_line, write_results  # benchmarks/ is this script's folder
from vllm import _custom_ops as ops
from vllm import envs

from vllm_dominotree.engine.cpu_attention import path_batch, recompute_rows, write_cache
from vllm_dominotree.engine.tree_step import TreeRows
from vllm_dominotree.tree.ancestry import tree_bits

HEADS, KV_HEADS, DIM, BLOCK, NUM_BLOCKS = 9, 3, 64, 128, 64
# vLLM's ISA per dtype: vec for float32; amx for bfloat16 where the CPU has AMX.
LAYOUTS = {"vec-float32": ("vec", torch.float32), "amx-bfloat16": ("amx", torch.bfloat16)}


def timed(fn, reps: int) -> float:
    fn()
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e6


def parents_of(shape: str, n: int, gen) -> list[int]:
    if shape == "bushy":  # every node a child of the root: n - 1 leaves
        return [-1] + [0] * (n - 1)
    # each node hangs off one of the three before it: a few leaves, as trees of a
    # weak drafter are
    return [-1] + [int(torch.randint(max(0, i - 3), i, (1,), generator=gen)) for i in range(1, n)]


def case(isa: str, dtype, context: int, shape: str, rows: int, reps: int, gen) -> dict:
    kv = torch.randn(NUM_BLOCKS, KV_HEADS, BLOCK, 2 * DIM).to(dtype)
    key_cache, value_cache = kv.view(NUM_BLOCKS, KV_HEADS, 2 * BLOCK, DIM).chunk(2, 2)
    table = torch.randperm(NUM_BLOCKS, generator=gen)[:16].int()
    query = torch.randn(rows, HEADS, DIM).to(dtype)
    pos = torch.arange(context, context + rows)
    slots = table.long()[pos // BLOCK] * BLOCK + pos % BLOCK
    keys = torch.randn(rows, KV_HEADS, DIM).to(dtype)
    values = torch.randn(rows, KV_HEADS, DIM).to(dtype)
    write_cache(kv, isa, keys, values, slots)

    def stock(n: int):
        seq = torch.tensor([context + n], dtype=torch.int32)
        starts = torch.tensor([0, n], dtype=torch.int32)
        schedule = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=1,
            num_heads=HEADS,
            num_kv_heads=KV_HEADS,
            head_dim=DIM,
            seq_lens=seq,
            dtype=dtype,
            query_start_loc=starts,
            causal=True,
            sliding_window_size=-1,
            isa=isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            kv_cache_dtype="auto",
        )
        out = torch.empty(n, HEADS, DIM, dtype=dtype)
        return lambda: ops.cpu_attention_with_kv_cache(
            query=query[:n],
            key_cache=key_cache,
            value_cache=value_cache,
            output=out,
            query_start_loc=starts,
            seq_lens=seq,
            scale=0.125,
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=table[None],
            softcap=0.0,
            scheduler_metadata=schedule,
            s_aux=None,
            k_scale=1.0,
            v_scale=1.0,
            kv_cache_dtype="auto",
        )

    parents = parents_of(shape, rows, gen)
    tree = TreeRows(0, 0, 0, context, rows, 0)
    ancestors, _, needs_fix = (a[0].numpy() for a in tree_bits(torch.tensor([parents])))
    paths = path_batch([(tree, needs_fix, ancestors, table)], BLOCK)
    impl = SimpleNamespace(
        num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=DIM, scale=0.125, kv_cache_dtype="auto"
    )
    output = torch.zeros(rows, HEADS * DIM, dtype=dtype)
    has_child = set(parents[1:])
    return {
        "context": context,
        "tree": shape,
        "rows": rows,
        "leaves": sum(1 for i in range(rows) if i not in has_child),
        "recomputed_rows": len(paths.query_rows),
        "path_requests": len(paths.seq_lens),
        "stock_1_row_us": timed(stock(1), reps),
        "stock_all_rows_us": timed(stock(rows), reps),
        "tree_recompute_us": timed(
            lambda: recompute_rows(impl, isa, query, keys, values, kv, output, paths), reps
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--layout", choices=list(LAYOUTS), default="vec-float32")
    parser.add_argument("--name", default="cpu_tree_attention_bench")
    args = parser.parse_args()
    isa, dtype = LAYOUTS[args.layout]
    if isa == "amx" and not torch.cpu._init_amx():  # asks the kernel for the AMX tiles
        parser.error("this CPU has no AMX: --layout vec-float32")
    torch.set_num_threads(2)  # as vLLM's CPU worker on this machine
    gen = torch.Generator().manual_seed(0)
    rows = [
        case(isa, dtype, context, shape, n, args.reps, gen)
        for context in (400, 1000)
        for shape, n in (("few leaves", 5), ("few leaves", 17), ("bushy", 17))
    ]
    intro = [
        f"# CPU tree attention per layer ({platform.machine()}, 2 threads)",
        "",
        f"`{command_line()}`: SmolLM2-135M's attention ({HEADS} heads, {KV_HEADS} KV heads, "
        f"dim {DIM}), {str(dtype)[6:]}, vLLM's `{isa}` cache layout in blocks of {BLOCK}; "
        "microseconds.",
    ]
    header = ["context", "tree", "rows", "leaves", "recomputed", "path requests", "kernel, 1 row"]
    header += ["kernel, all rows", "tree recompute"]
    table = [
        [r["context"], r["tree"], r["rows"], r["leaves"], r["recomputed_rows"], r["path_requests"]]
        + [f"{r[k]:.0f}" for k in ("stock_1_row_us", "stock_all_rows_us", "tree_recompute_us")]
        for r in rows
    ]
    print(write_results(args.out, args.name, {"cases": rows}, header, table, intro))


if __name__ == "__main__":
    main()
