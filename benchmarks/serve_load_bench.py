"""Serving under mixed load: latency and throughput with and without DominoTree, and a
soak that watches the server's memory.

    python benchmarks/serve_load_bench.py --out benchmarks/results/serve_load_cpu \\
        [--target DIR --drafter DIR] [--requests 96] [--concurrency 64] [--soak-minutes 10]

Starts vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`) once per
method (no speculation, DominoTree) on the same target and KV settings as the load
test (tests/engine/test_server_load.py), sends the same mixed streamed traffic
(vllm_dominotree/evaluation/load.py: greedy and seeded sampled requests, some abandoned
mid-stream, some refused), and records TTFT and time per output token percentiles of
the completed requests and output tokens per second. Without --target the toy pair is
written to a temporary folder (its drafts are often right; CPU only). With
--soak-minutes the DominoTree server then takes the same traffic in waves for that long
while the resident memory of the server and its engine processes is sampled after every
wave. Writes serve_load.json / serve_load.md (and soak.json / soak.md).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from results_io import command_line, write_results  # benchmarks/ is this script's folder

from vllm_dominotree.evaluation.load import mixed_load, run_load, summary
from vllm_dominotree.evaluation.server import ApiServer

SERVED_NAME = "bench"
KV_ARGS = ["--num-gpu-blocks-override", "24", "--block-size", "32", "--max-num-seqs", "64"]


def server_args(args, speculative: dict | None) -> list[str]:
    out = [
        "--served-model-name",
        SERVED_NAME,
        "--dtype",
        args.dtype,
        "--max-model-len",
        "512",
        "--seed",
        "0",
        "--max-num-batched-tokens",
        "256",
        *KV_ARGS,
    ]
    if args.enforce_eager:
        out.append("--enforce-eager")
    if speculative:
        out += ["--speculative-config", json.dumps(speculative)]
    return out


def rss_mib(pid: int) -> float:
    """Resident memory of a process and all its descendants (Linux /proc), MiB."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--target")
    parser.add_argument("--drafter")
    parser.add_argument("--vocab", type=int, default=60, help="prompt token ids drawn below this")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--soak-minutes", type=float, default=0.0)
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()
    if args.target is None:
        from vllm_dominotree.demo.toy_pair import PairSpec, write_pair

        target, drafter = write_pair(Path(tempfile.mkdtemp()), PairSpec(noise=0.8, context=1.4))
        args.target, args.drafter = str(target), str(drafter)
    load = mixed_load(args.requests, args.vocab, seed=5)
    methods = {
        "no speculation": None,
        "dominotree": {"method": "dominotree", "model": args.drafter},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    rows, results = [], {}
    for name, speculative in methods.items():
        log = Path(tempfile.mkdtemp()) / f"server_{name.replace(' ', '_')}.log"
        print(name, "server log:", log, flush=True)
        server = ApiServer.start(args.target, log, server_args(args, speculative))
        try:
            server.wait_healthy(300)
            run_load(server.url, SERVED_NAME, load[:16], 16, 240)  # warm-up
            got, wall = run_load(server.url, SERVED_NAME, load, args.concurrency, 240)
            results[name] = summary(got, wall)
            print(name, json.dumps(results[name]), flush=True)
            if speculative and args.soak_minutes:
                soak(server, load, args)
        finally:
            server.stop()
        r = results[name]
        rows.append(
            [
                name,
                f"{r['completed']}/{r['requests']}",
                f"{r['output_tokens_per_s']:.0f}",
                *(f"{r['ttft_ms'][p]:.0f}" for p in ("p50", "p90", "p99")),
                *(f"{r['tpot_ms'][p]:.1f}" for p in ("p50", "p90", "p99")),
            ]
        )
    write_results(
        args.out,
        "serve_load",
        {"command": command_line(), "args": vars(args), "results": results},
        [
            "method",
            "completed",
            "output tok/s",
            "TTFT p50 ms",
            "p90",
            "p99",
            "TPOT p50 ms",
            "p90",
            "p99",
        ],
        rows,
        [
            "# Serving under mixed load (CPU)",
            "",
            f"`{command_line()}`: {args.requests} streamed completions, {args.concurrency} at "
            "a time (greedy, seeded sampled, some abandoned mid-stream, some refused), on "
            "a KV cache of 24 x 32 slots (the scheduler preempts); latencies over the "
            "completed requests. Without speculation the requests with `logprobs` are not "
            "refused: they complete.",
        ],
    )


def soak(server: ApiServer, load, args) -> None:
    """The same traffic in waves for --soak-minutes; memory after every wave."""
    samples, end = [], time.monotonic() + 60 * args.soak_minutes
    start = time.monotonic()
    while time.monotonic() < end:
        got, wall = run_load(server.url, SERVED_NAME, load, args.concurrency, 240)
        completed = sum(r.finish_reason == "length" for r in got)
        samples.append(
            {
                "minute": (time.monotonic() - start) / 60,
                "rss_mib": rss_mib(server.proc.pid),
                "completed": completed,
                "wall_s": wall,
                "alive": server.alive(),
            }
        )
        print("soak", json.dumps(samples[-1]), flush=True)
    warm = samples[min(1, len(samples) - 1)]["rss_mib"]  # after the first wave: warmed up
    peak = max(s["rss_mib"] for s in samples)
    rows = [
        [f"{s['minute']:.1f}", f"{s['rss_mib']:.0f}", s["completed"], f"{s['wall_s']:.1f}"]
        for s in samples
    ]
    write_results(
        args.out,
        "soak",
        {"command": command_line(), "samples": samples, "warm_mib": warm, "peak_mib": peak},
        ["minute", "server RSS MiB (all processes)", "completed requests", "wave s"],
        rows,
        [
            "# Soak: the DominoTree server under the same mixed traffic (CPU)",
            "",
            f"`{command_line()}`: waves of {len(load)} requests for {args.soak_minutes} "
            f"minutes; resident memory of the server and its engine processes after every "
            f"wave. After the first wave {warm:.0f} MiB, peak {peak:.0f} MiB "
            f"({peak - warm:+.0f} MiB).",
        ],
    )


if __name__ == "__main__":
    main()
