"""The vocabulary's top M per depth, as the scorers' prepare takes it (tree/scorers.py):
torch.topk over each whole row against two stages of torch.topk (each of a row's equal
chunks' top M, then the row's top M of those), which gives the GPU many short slices
where 16 rows of 151,936 logits give it 16 long ones.

    python benchmarks/vocab_topk_bench.py --out DIR [--device cuda] [--batches 1 16 64]

Rows = batch x 16 depths of random bf16 logits (Qwen3's vocabulary), M 64. On CUDA each
variant is captured in a CUDA graph (the build replays prepare inside its graph) and timed
over --rounds replays with events; on CPU, eagerly. Each variant must give torch.topk's
values, best first, at indices that hold them (equal values may come in another order).
The top M in a Triton kernel of its own was slower than torch.topk at every batch
(benchmarks/results/h100_2026-12-05d/builder_topk/). Writes vocab_topk_bench.{json,md}.
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

DEPTHS = 16


def two_stage_topk(logits: torch.Tensor, k: int, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, V] -> the top k (values, indices) best first, by each of `chunks` equal
    chunks' top k (V divisible by chunks), then the top k of those."""
    rows, width = logits.shape
    parts = logits.view(rows, chunks, width // chunks)
    values, index = parts.topk(k, dim=-1, sorted=False)  # [rows, chunks, k]
    offsets = torch.arange(chunks, device=logits.device) * (width // chunks)
    best, at = values.flatten(1).topk(k, dim=-1)  # [rows, k]
    return best, (index + offsets[:, None]).flatten(1).gather(1, at)


def variants(width: int, chunk_counts: list[int]) -> dict[str, Callable]:
    found = {"torch.topk": lambda x, k: x.topk(k, dim=-1)}
    for c in chunk_counts:
        if width % c == 0:
            found[f"two stages, {c} chunks"] = lambda x, k, c=c: two_stage_topk(x, k, c)
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
    parser.add_argument("--chunks", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in args.batches:
        logits = (3 * torch.randn(batch * DEPTHS, args.vocab, generator=gen)).bfloat16()
        logits = logits.to(device)
        for name, fn in variants(args.vocab, args.chunks).items():
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
