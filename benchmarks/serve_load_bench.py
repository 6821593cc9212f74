"""Serving under mixed load: latency and throughput with and without DominoTree, and a
soak that watches the server's memory.

    python benchmarks/serve_load_bench.py --out benchmarks/results/serve_load_cpu \\
        [--target DIR --drafter DIR | --shape qwen3-4b] [--requests 96] [--concurrency 64]
        [--soak-minutes 10] [--cli serve] [--kv-cache-gib 2]

Starts vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`) once per
method (no speculation, DominoTree) on the same target and KV settings as the load
test (tests/engine/test_server_load.py), sends the same mixed streamed traffic
(vllm_dominotree/evaluation/load.py: greedy and seeded sampled requests, some abandoned
mid-stream, some refused; on CPU without the seeded ones, which kill vLLM 0.32's CPU
engine without speculation), and records TTFT and time per output token percentiles of
the completed requests and output tokens per second; the greedy requests' outputs must be
the same for every method, and the servers' `dominotree_` and spec-decode figures from
`GET /metrics` are recorded. Without --target the toy pair is written to a temporary
folder (its drafts are often right); --shape writes random models of a real shape as
benchmarks/round_cost_bench.py does (a random drafter accepts next to nothing) and
serves them without a tokenizer. On CUDA: --cli serve runs `vllm serve` itself, and
--kv-cache-gib gives each server a fixed KV cache (vLLM's memory profiler then does not
run, so other processes may share the GPU). With
--soak-minutes each server then takes the same traffic in waves for that long while the
resident memory of its processes is sampled after every wave (without speculation too:
what grows in both is vLLM's). Writes serve_load.json / serve_load.md (and soak.json / soak.md).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from results_io import command_line, write_results  # benchmarks/ is this script's folder

from vllm_dominotree.evaluation.load import mixed_load, run_load, summary
from vllm_dominotree.evaluation.server import ApiServer, ServerError, log_tail

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
    if args.shape:
        out.append("--skip-tokenizer-init")
    if args.kv_cache_gib:
        out += ["--gpu-memory-utilization", "0.08"]
        out += ["--kv-cache-memory-bytes", str(int(args.kv_cache_gib * 2**30))]
    elif not torch.cuda.is_available():
        # vLLM's CPU backend wants that share of the node's memory free at startup, and
        # the first server's is not always all given back by then (the second server
        # once found 18.25 of 19.84 GiB free against 0.92 wanted and refused to start);
        # the KV cache is fixed by KV_ARGS, so half is plenty.
        out += ["--gpu-memory-utilization", "0.5"]
    if speculative:
        out += ["--speculative-config", json.dumps(speculative)]
    return out


def rss_mib(pid: int) -> dict[str, float]:
    """Resident memory (MiB) of a process and all its descendants (Linux /proc), by
    process name (vLLM names its engine process `VLLM::EngineCore`)."""
    by_name: dict[str, float] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text().splitlines()
            name = next(line.split(None, 1)[1] for line in status if line.startswith("Name:"))
            rss = sum(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS:"))
            by_name[name] = by_name.get(name, 0.0) + rss
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return by_name


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
    parser.add_argument("--shape", help="random target and drafter of this round_cost_bench shape")
    parser.add_argument("--models", type=Path, help="where --shape's models go (default: --out)")
    parser.add_argument("--cli", choices=["api_server", "serve"], default="api_server")
    parser.add_argument("--kv-cache-gib", type=float, help="CUDA: a fixed KV cache per server")
    args = parser.parse_args()
    if args.shape:
        from round_cost_bench import write_models

        device = "cuda" if torch.cuda.is_available() else "cpu"
        dirs = write_models(args.models or args.out / "models", args.shape, device)
        args.target, args.drafter = dirs["target"], dirs["domino"]
    elif args.target is None:
        from vllm_dominotree.demo.toy_pair import PairSpec, write_pair

        target, drafter = write_pair(Path(tempfile.mkdtemp()), PairSpec(noise=0.8, context=1.4))
        args.target, args.drafter = str(target), str(drafter)
    # vLLM 0.32's CPU runner without speculation dies on a seeded request whose prefill
    # is chunked (it rewinds the request's CPU generator, which raises "CPU Generator
    # does not use offset"; the API server then exits 0): on CPU both servers take the
    # load without its seeded requests, so that they serve the same traffic.
    on_cpu = not torch.cuda.is_available()
    load = [
        r for r in mixed_load(args.requests, args.vocab, seed=5) if not on_cpu or r.kind != "seeded"
    ]
    methods = {
        "no speculation": None,
        "dominotree": {"method": "dominotree", "model": args.drafter},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    rows, results, greedy, soaks = [], {}, {}, {}
    for name, speculative in methods.items():
        log = Path(tempfile.mkdtemp()) / f"server_{name.replace(' ', '_')}.log"
        print(name, "server log:", log, flush=True)
        server = ApiServer.start(args.target, log, server_args(args, speculative), cli=args.cli)
        try:
            server.wait_healthy(300)
            run_load(server.url, SERVED_NAME, load[:16], 16, 240)  # warm-up
            got, wall = run_load(server.url, SERVED_NAME, load, args.concurrency, 240)
            results[name] = summary(got, wall) | {
                "metrics": served_figures(server.metrics()),
                "failed": [r.request.index for r in got if r.request.kind != "reject" and r.error],
            }
            greedy[name] = {r.request.index: r.tokens for r in got if r.request.kind == "greedy"}
            print(name, json.dumps(results[name]), flush=True)
            if args.soak_minutes:
                soaks[name] = soak(server, load, args)
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
    base = greedy["no speculation"]
    differing = sorted(i for i, tokens in greedy["dominotree"].items() if tokens != base[i])
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    spec = results["dominotree"]["metrics"]
    write_results(
        args.out,
        "serve_load",
        {
            "command": command_line(),
            "device": device,
            "args": vars(args),
            "results": results,
            "greedy_requests": len(base),
            "greedy_outputs_differing": differing,
        },
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
            f"# Serving under mixed load ({device})",
            "",
            f"`{command_line()}` (`{args.cli}`): {args.requests} streamed completions, "
            f"{args.concurrency} at a time (greedy, "
            + ("" if on_cpu else "seeded sampled, ")
            + "some abandoned mid-stream, some refused; on CPU no seeded request, which "
            "kills vLLM's CPU engine without speculation), on a KV cache of 24 x 32 slots "
            "(the scheduler "
            "preempts); latencies over the completed requests. Without speculation the "
            "requests with `bad_words` are not refused: they complete.",
        ],
        [
            "",
            f"Greedy outputs differing from the server without speculation: {len(differing)} "
            f"of {len(base)}. The DominoTree server's /metrics after the load: "
            + ", ".join(f"`{k}` {v:g}" for k, v in spec.items() if not k.endswith("_bucket"))
            + ".",
        ],
    )
    if soaks:
        write_soak(args.out, soaks, len(load), args.soak_minutes)
    if differing:
        raise SystemExit(f"greedy outputs differ from no speculation: requests {differing}")


def served_figures(metrics: dict[str, float]) -> dict[str, float]:
    """The plugin's and vLLM's speculative-decoding samples of a /metrics scrape."""
    return {
        name: value
        for name, value in metrics.items()
        if name.startswith(("dominotree_", "vllm:spec_decode")) and not name.endswith("_created")
    }


def soak(server: ApiServer, load, args) -> list[dict]:
    """The same traffic in waves for --soak-minutes; memory after every wave."""
    samples, end = [], time.monotonic() + 60 * args.soak_minutes
    start = time.monotonic()
    while time.monotonic() < end:
        got, wall = run_load(server.url, SERVED_NAME, load, args.concurrency, 240)
        samples.append(
            {
                "minute": (time.monotonic() - start) / 60,
                "rss_mib": rss_mib(server.proc.pid),
                "completed": sum(r.finish_reason == "length" for r in got),
                "wall_s": wall,
                "alive": server.alive(),
            }
        )
        print("soak", json.dumps(samples[-1]), flush=True)
        if not server.alive():
            raise ServerError(f"the server died during the soak:\n{log_tail(server.log)}")
    return samples


def write_soak(out: Path, soaks: dict[str, list[dict]], requests: int, minutes: float) -> None:
    """One table: each method's memory per process after every wave, and the growth after
    the first wave (warm-up) and over the second half of the soak."""
    names = sorted({n for samples in soaks.values() for s in samples for n in s["rss_mib"]})
    rows, growth = [], {}
    for method, samples in soaks.items():
        for s in samples:
            cells = [f"{s['rss_mib'].get(n, 0):.0f}" for n in names]
            rows.append(
                [method, f"{s['minute']:.1f}", *cells, s["completed"], f"{s['wall_s']:.1f}"]
            )
        warm, half, last = (
            samples[min(1, len(samples) - 1)],
            samples[len(samples) // 2],
            samples[-1],
        )
        growth[method] = {
            n: {
                "after_warm_up_mib": last["rss_mib"].get(n, 0) - warm["rss_mib"].get(n, 0),
                "second_half_mib": last["rss_mib"].get(n, 0) - half["rss_mib"].get(n, 0),
            }
            for n in names
        }
    lines = [
        f"- {method}, {n}: {g['after_warm_up_mib']:+.0f} MiB after the first wave, "
        f"{g['second_half_mib']:+.0f} MiB over the second half"
        for method, by_name in growth.items()
        for n, g in by_name.items()
    ]
    write_results(
        out,
        "soak",
        {"command": command_line(), "samples": soaks, "growth": growth},
        ["method", "minute", *(f"{n} RSS MiB" for n in names), "completed", "wave s"],
        rows,
        [
            "# Soak: each server under the same mixed traffic",
            "",
            f"`{command_line()}`: waves of {requests} requests for {minutes} minutes per "
            "server; resident memory of the server's processes (by name) after every wave.",
            "",
            *lines,
        ],
    )


if __name__ == "__main__":
    main()
