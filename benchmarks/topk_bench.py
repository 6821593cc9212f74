"""The build's vocabulary top-k: one torch.topk over [N, V] against the top-k of each chunk
of V, then of those (scorers.top_k_in_chunks), on CUDA.

    python benchmarks/topk_bench.py --out benchmarks/results/DIR

Each step's scorer takes the top-M (conditional, M 64) or top-C (marginal) of the
drafter's [requests x 16, V] logits. On the H200 (2026-12-04c, batch 1) the one
torch.topk over Qwen3's 151,936 logits was 0.36 ms of the build's 0.86 ms of kernels: a
multi-block radix select for a few wide rows. Reports the GPU time of each (CUDA
events, median of 50 launches) and whether the values equal torch.topk's.
Writes topk.json / .md.
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

import torch
from results_io import command_line, write_results  # benchmarks/ is this script's folder
from tree_rounding_bench import gpu_ms

from vllm_dominotree.tree.scorers import top_k_in_chunks


def measure(logits: torch.Tensor, k: int, chunks: list[int]) -> dict:
    """GPU ms of torch.topk and of each chunking over logits [N, V], and whether each
    chunking gives torch.topk's values (with indices that hold them)."""
    want = logits.topk(k, dim=-1)
    case = {"topk_ms": gpu_ms(partial(logits.topk, k, dim=-1), repeats=50)}
    for chunk in chunks:
        values, index = top_k_in_chunks(logits, k, chunk)
        case[f"chunk {chunk}"] = {
            "ms": gpu_ms(partial(top_k_in_chunks, logits, k, chunk), repeats=50),
            "same_values": bool(torch.equal(values, want.values)),
            "indices_right": bool(torch.equal(logits.gather(1, index), values)),
        }
    return case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vocab", type=int, nargs="+", default=[151936, 49152])
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--drafts", type=int, default=16, help="positions per request")
    parser.add_argument("--k", type=int, nargs="+", default=[64, 16])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    args = parser.parse_args()
    torch.manual_seed(0)
    found, rows = [], []
    for vocab in args.vocab:
        for requests in args.requests:
            n = requests * args.drafts
            logits = torch.randn(n, vocab, device="cuda").mul(3).to(torch.bfloat16)
            for k in args.k:
                case = {"vocab": vocab, "requests": requests, "rows": n, "k": k}
                case |= measure(logits, k, args.chunks)
                found.append(case)
                chunked = [case[f"chunk {c}"] for c in args.chunks]
                fastest = min(args.chunks, key=lambda c: case[f"chunk {c}"]["ms"])
                exact = all(c["same_values"] and c["indices_right"] for c in chunked)
                rows.append(
                    [vocab, requests, n, k, f"{case['topk_ms'] * 1000:.1f}"]
                    + [f"{c['ms'] * 1000:.1f}" for c in chunked]
                    + [fastest, exact]
                )
                print(rows[-1], flush=True)
    device = torch.cuda.get_device_name()
    header = ["vocab", "requests", "rows", "k", "torch.topk us"]
    header += [f"chunks of {c} us" for c in args.chunks] + ["fastest chunk", "values equal"]
    intro = [
        f"# Vocabulary top-k ({device})",
        "",
        f"`{command_line()}`: GPU us per call (CUDA events, median of 50).",
    ]
    payload = {"command": command_line(), "device": device, "cases": found}
    print(write_results(args.out, "topk", payload, header, rows, intro=intro))


if __name__ == "__main__":
    main()
