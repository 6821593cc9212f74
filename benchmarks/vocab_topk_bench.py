"""The vocabulary's top M per depth, as the scorers' prepare takes it (tree/scorers.py):
torch.topk over each whole row against the top M through the chunks' maxima (a reduction
over the row, the top M chunks by their maxima, the top M of those chunks' logits), with
torch.topk's order among equal values, with keys without ties (equal values in index
order) for the chunks' top M only, or for both top-M's, for chunks of each size given.

    python benchmarks/vocab_topk_bench.py --out DIR [--device cuda] [--batches 1 16 64]

Rows = batch x 16 depths of random bf16 logits (Qwen3's vocabulary), M 64. On CUDA each
variant is captured in a CUDA graph (the build replays prepare inside its graph) and timed
over --rounds replays with events; on CPU, eagerly. Each variant must give torch.topk's
values, best first, at indices that hold them (equal values may come in another order),
and the table says whether three more calls and (CUDA) the graph's replays gave the same
indices: the device builder prepares inside its graph, the host heap eagerly, and their
trees must be equal.

Measured (H100, 2026-12-07e, `../results/h100_2026-12-07e/`): the chunk maxima with
torch.topk's tie order took 0.22 / 0.62 ms at batch 16 / 64 against torch.topk's 0.40 /
1.21, but the builder bench's device trees then differed from the host heap's at batch 16;
with keys without ties they took 0.44 / 1.30, slower than torch.topk at every batch. So
the scorers keep torch.topk. Keys without ties for the chunks' top M alone came after
that run: not measured yet. Slower than torch.topk at every batch, and removed before: the
top M in a Triton kernel of its own (h100_2026-12-05d/builder_topk/) and two stages of
torch.topk over equal chunks (h100_2026-12-05e/vocab_topk/). Writes
vocab_topk_bench.{json,md}.
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


# Which of chunk_maxima_topk's two short top-k's take keys without ties.
TIE_FREE = {"": (), ", chunks' keys without ties": ("chunks",),
            ", keys without ties": ("chunks", "logits")}  # fmt: skip


def chunk_maxima_topk(
    logits: torch.Tensor, k: int, chunk: int, tie_free: tuple[str, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, W] (W a multiple of chunk, at least k chunks) -> the top k (values, indices),
    best first. The k chunks of the largest maxima hold a row's k largest values (any
    value outside them is at most the k-th largest maximum, and those k maxima are k
    values of the row at least as large). tie_free: the top-k's ("chunks": over the
    chunks' maxima, "logits": over the chosen chunks' logits) that take keys without ties
    (tie_free_keys): equal values in index order, as a stable sort gives them; the others
    in torch.topk's order. With both, the whole result is a stable sort's first k."""
    rows, width = logits.shape
    chunks = width // chunk
    parts = logits.view(rows, chunks, chunk)
    maxima = parts.amax(dim=-1)  # [rows, chunks]
    if "chunks" in tie_free:
        maxima = tie_free_keys(maxima, torch.arange(chunks, device=logits.device))
    best = maxima.topk(k, dim=-1).indices.sort(dim=-1).values  # [rows, k] in index order
    picked = parts.gather(1, best[..., None].expand(-1, -1, chunk)).flatten(1)  # [rows, k chunk]
    keys = picked
    if "logits" in tie_free:
        keys = tie_free_keys(picked, torch.arange(k * chunk, device=logits.device))
    at = keys.topk(k, dim=-1).indices  # [rows, k]
    return picked.gather(1, at), best.gather(1, at // chunk) * chunk + at % chunk


def tie_free_keys(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Integer keys of values [..., n] (16- or 32-bit floats) that order as the values,
    descending, then by index ([n] distinct, < 2^16 for 16-bit values), ascending: no two
    keys of a row equal. The float's magnitude bits above the tie-break's, negated for
    negative values (IEEE floats order as sign and magnitude); -0.0 taken as +0.0."""
    bits = values.element_size() * 8
    as_int = {16: torch.int16, 32: torch.int32}[bits]
    wide, low = (torch.int32, 16) if bits == 16 else (torch.int64, 32)
    raw = (values + 0).view(as_int).to(wide)
    negative = raw < 0
    magnitude = raw & ((1 << (bits - 1)) - 1)
    tie = torch.where(negative, index, (1 << low) - 1 - index)  # lower index: larger key
    key = (magnitude << low) | tie
    return torch.where(negative, -key, key)


def variants(width: int, k: int, chunk_sizes: list[int]) -> dict[str, Callable]:
    """torch.topk, and the chunk maxima's top k each TIE_FREE way for each chunk size that
    leaves at least 4 k chunks (and fewer than 2^16)."""
    found = {"torch.topk": lambda x, k: x.topk(k, dim=-1)}
    for c in chunk_sizes:
        if width % c == 0 and 4 * k <= width // c < 1 << 16 and k * c < 1 << 16:
            for name, tie_free in TIE_FREE.items():
                found[f"chunk maxima, chunks of {c}{name}"] = lambda x, k, c=c, t=tie_free: (
                    chunk_maxima_topk(x, k, c, t)
                )
    return found


def same_every_call(
    fn: Callable, logits: torch.Tensor, k: int, index: torch.Tensor, in_graph: torch.Tensor | None
) -> bool:
    """Whether three more eager calls and, on CUDA, the captured graph's replay (in_graph:
    its indices) give the indices of the first eager call: the device builder prepares
    inside its graph, the host heap eagerly, and their candidates must be the same."""
    eager = all(torch.equal(fn(logits, k)[1], index) for _ in range(3))
    return eager and (in_graph is None or torch.equal(in_graph, index))


def is_the_top(logits: torch.Tensor, k: int, values: torch.Tensor, index: torch.Tensor) -> bool:
    """torch.topk's values, best first, each at an index (distinct) that holds it."""
    want = logits.topk(k, dim=-1).values
    distinct = bool((index.sort(-1).values.diff(dim=-1) > 0).all())
    return torch.equal(values, want) and torch.equal(logits.gather(1, index), values) and distinct


def time_ms(
    fn: Callable, logits: torch.Tensor, k: int, rounds: int
) -> tuple[float, torch.Tensor | None]:
    """Median ms of one call: CUDA graph replays timed with events (and the indices the
    graph's replays gave), or eager calls (None)."""
    if logits.device.type == "cuda":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):  # warm-up outside the capture (allocations, kernel choice)
                fn(logits, k)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _, index = fn(logits, k)
        times = []
        for _ in range(rounds):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times), index.clone()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn(logits, k)
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times), None


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
            ms, in_graph = time_ms(fn, logits, args.m, args.rounds)
            row = {
                "batch": batch,
                "rows": batch * DEPTHS,
                "variant": name,
                "ms_median": ms,
                "is_the_top": is_the_top(logits, args.m, values, index),
                "same_every_call": same_every_call(fn, logits, args.m, index, in_graph),
            }
            rows.append(row)
            print(row, flush=True)
    cuda = device.type == "cuda"
    device_name = torch.cuda.get_device_name() if cuda else f"CPU, {platform.machine()}"
    write_results(
        args.out,
        "vocab_topk_bench",
        {"command": command_line(), "device": device_name, "rows": rows},
        ["batch", "rows", "variant", "ms (median)", "torch.topk's values", "same every call"],
        [
            [
                r["batch"],
                r["rows"],
                r["variant"],
                f"{r['ms_median']:.4f}",
                r["is_the_top"],
                r["same_every_call"],
            ]
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
