"""The vocabulary's top M per depth, as the scorers' prepare takes it (tree/scorers.py):
torch.topk over each whole row against the top M through the chunks' maxima
(scorers.vocab_topk, CUDA's default: a reduction over the row, the top M chunks, the top M
of their logits), for chunks of each size given.

    python benchmarks/vocab_topk_bench.py --out DIR [--device cuda] [--batches 1 16 64]

Rows = batch x 16 depths of random bf16 logits (Qwen3's vocabulary), M 64. On CUDA each
variant is captured in a CUDA graph (the build replays prepare inside its graph) and timed
over --rounds replays with events; on CPU, eagerly. Each variant must give torch.topk's
values, best first, at indices that hold them (equal values may come in another order).
Slower than torch.topk at every batch, and removed: the top M in a Triton kernel of its own
(benchmarks/results/h100_2026-12-05d/builder_topk/) and two stages of torch.topk over
equal chunks (h100_2026-12-05e/vocab_topk/). Writes vocab_topk_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from results_io import command_line, write_results  # benchmarks/ is this script's folder

from vllm_dominotree.tree.scorers import vocab_topk

DEPTHS = 16


def variants(width: int, k: int, chunk_sizes: list[int]) -> dict[str, Callable]:
    """torch.topk, and the chunk maxima's top k for each chunk size that takes that path
    (vocab_topk falls back to torch.topk otherwise: no variant then)."""
    found = {"torch.topk": lambda x, k: x.topk(k, dim=-1)}
    for c in chunk_sizes:
        if width % c == 0 and width // c >= 4 * k:
            found[f"chunk maxima, chunks of {c}"] = lambda x, k, c=c: vocab_topk(
                x, k, chunked=True, chunk=c
            )
    return found


def is_the_top(logits: torch.Tensor, k: int, values: torch.Tensor, index: torch.Tensor) -> bool:
    """torch.topk's values, best first, each at an index (distinct) that holds it."""
    want = logits.topk(k, dim=-1).values
    distinct = bool((index.sort(-1).values.diff(dim=-1) > 0).all())
    return torch.equal(values, want) and torch.equal(logits.gather(1, index), values) and distinct


def time_ms(fn: Callable, logits: torch.Tensor, k: int, rounds: int) -> float:
    """Median ms of one call: CUDA graph replays timed with events, or eager calls."""
    if logits.device.type == "cuda":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):  # warm-up outside the capture (allocations, kernel choice)
                fn(logits, k)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(logits, k)
        times = []
        for _ in range(rounds):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn(logits, k)
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--m", type=int, default=64)
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in args.batches:
        logits = (3 * torch.randn(batch * DEPTHS, args.vocab, generator=gen)).bfloat16()
        logits = logits.to(device)
        for name, fn in variants(args.vocab, args.m, args.chunk_sizes).items():
            values, index = fn(logits, args.m)
            row = {
                "batch": batch,
                "rows": batch * DEPTHS,
                "variant": name,
                "ms_median": time_ms(fn, logits, args.m, args.rounds),
                "is_the_top": is_the_top(logits, args.m, values, index),
            }
            rows.append(row)
            print(row, flush=True)
    cuda = device.type == "cuda"
    device_name = torch.cuda.get_device_name() if cuda else f"CPU, {platform.machine()}"
    write_results(
        args.out,
        "vocab_topk_bench",
        {"command": command_line(), "device": device_name, "rows": rows},
        ["batch", "rows", "variant", "ms (median)", "torch.topk's values"],
        [
            [r["batch"], r["rows"], r["variant"], f"{r['ms_median']:.4f}", r["is_the_top"]]
            for r in rows
        ],
        [
            f"# The vocabulary's top {args.m} per depth ({device_name}, bf16)",
            "",
            f"`{command_line()}`; {args.vocab} logits a row, median of {args.rounds} "
            + ("CUDA graph replays." if cuda else "eager calls."),
        ],
    )
    if not all(r["is_the_top"] for r in rows):
        raise SystemExit("a variant gave other values than torch.topk")


if __name__ == "__main__":
    main()
