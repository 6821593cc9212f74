"""Tree-attention kernel time per layer call on Qwen3-4B attention shapes (CUDA).

    python benchmarks/tree_attention_bench.py --out benchmarks/results

32 query heads, 8 KV heads, head dim 128, bf16, pages of 16; per request a tree of
`rows` rows (budget + root) after a committed context, all but two rows needing the
fix; the fix-up's device time (one or two launches) inside a CUDA graph. Writes
tree_attention_bench.json / .md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from results_io import command_line, write_results  # benchmarks/ is this script's folder

from vllm_dominotree.kernels.tree_attention import TreeAttention
from vllm_dominotree.tree.ancestry import tree_bits

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16


def case(batch: int, context: int, rows: int):
    """Per request a `rows`-row tree (root + budget) of one root-to-leaf path and single
    children hanging off the root: every row but the path's needs a fix."""
    pages = (context + rows + PAGE - 1) // PAGE
    block_table = torch.arange(batch * pages, dtype=torch.int32, device="cuda").view(batch, pages)
    cache = torch.randn(
        batch * pages, PAGE, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16
    )
    query = torch.randn(batch * rows, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    parents = torch.tensor([[-1, *([0] * (rows - 1))]])  # a star: rows 2.. need the fix
    ancestors, _, needs_fix = (a.numpy() for a in tree_bits(parents))
    meta = (
        torch.arange(0, batch * rows + 1, rows, dtype=torch.int32, device="cuda"),
        torch.full((batch,), context + rows, dtype=torch.int32, device="cuda"),
        torch.from_numpy(np.tile(ancestors[0], batch)).cuda(),
        torch.from_numpy(np.tile(needs_fix[0], batch).astype(np.int64)).cuda(),
    )
    return query, cache, cache, block_table, *meta


def time_us(fn, repeats: int = 50) -> float:
    """Device time per call: `repeats` calls captured in one CUDA graph (as the fix-up
    runs inside vLLM's FULL graphs), replayed, timed with CUDA events."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    results = []
    for batch in (1, 4, 16, 64):
        for context in (128, 512, 2048, 8192):
            for rows in (17, 33):
                inputs = case(batch, context, rows)
                out = torch.empty_like(inputs[0])
                kernel = TreeAttention(HEADS, HEAD_DIM, rows, "cuda")
                us = time_us(lambda i=inputs, o=out, k=kernel: k(*i, 0.088, o))
                results.append({"batch": batch, "context": context, "rows": rows, "us": us})
                print(json.dumps(results[-1]), flush=True)
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "command": command_line(),
    }
    intro = [
        f"# Tree-attention kernel per layer call ({meta['device']}, bf16)",
        "",
        "Qwen3-4B attention shapes (32 heads, 8 KV heads, head dim 128), pages of 16;",
        f"`{meta['command']}`; device time per call: 50 calls in one CUDA graph, as",
        "under vLLM's FULL graphs, timed with CUDA events.",
    ]
    table = [[r["batch"], r["context"], r["rows"], f"{r['us']:.1f}"] for r in results]
    write_results(
        args.out,
        "tree_attention_bench",
        {"meta": meta, "rows": results},
        ["batch", "context", "tree rows", "us per layer call"],
        table,
        intro,
    )


if __name__ == "__main__":
    main()
