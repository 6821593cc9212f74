"""What one speculative round costs in vLLM: DominoTree against vLLM's own DFlash chain
and plain decoding, on random weights of a real shape.

    python benchmarks/round_cost_bench.py --out DIR [--shape qwen3-4b|qwen3-8b|tiny] \\
        [--tensor-parallel-size 1] [--batches 1 4 16 64] \\
        [--methods ar dflash dflash-v1 chain marginal conditional chain-v2 conditional-v2] \\
        [--tokens 64] [--prompt-tokens 128] [--repeats 3] [--enforce-eager] [--no-split]

A plugin method may carry variants as suffixes (VARIANTS): `-sync` runs it with vLLM's
synchronous scheduling instead of its default (asynchronous on CUDA), `-vllm-draft` with
vLLM's piecewise query pass instead of the plugin's drafter graphs, `-prepare-apart` with
the drafter's logits and the scorer's preparation eager before the build instead of in
its graph, `-paths` / `-fixup` / `-one-pass` / `-one-pass-fixup` / `-one-pass-merge` with the tree
rows through FA3 path requests / the Triton fix-up kernel / path requests for every row
and no stock pass / the fix-up's kernel for every row and no stock pass / FA3 over each
prefix plus the trees' own part, merged (kernels/tree_merge.py),
`-splits1` with the path requests in one FA3 key split (DOMINOTREE_PATH_SPLITS), `-triton`
/ `-torch-step` with the conditional scorer's per-node step and the builder's pop as
Triton launches (CUDA's default since 2026-12-06c) / as compiled torch code
(DOMINOTREE_NODE_STEP), `-accept-torch` with the trees accepted by torch code instead of
the Triton launch that is CUDA's default (DOMINOTREE_ACCEPT_KERNEL), `-graphs1088` (any
method, vLLM's `dflash` too) with vLLM's own knob max_cudagraph_capture_size=1088: decode
graphs for steps of up to 64 requests of 17 rows, where vLLM's default stops at 512
tokens (the plugin's engines reach them by default, option graph_requests), e.g.
`conditional-sync`, `conditional-one-pass-splits1` or `dflash-graphs1088`; and,
last, `-vocabS` drafting from a draft vocabulary of S tokens (option draft_vocab; the
first S of a random ranking written beside the random drafter) and `-mM` correcting M
candidates per depth (option candidates; 151936 for Qwen3's whole vocabulary: the
chain's released decoder) and `-bN` drafting N nodes a request (option budget, as on
CUDA otherwise: 16, the chain 15, which verifies the 16 rows of vLLM's DFlash;
`chain-v2-b16` drafts all 16 of the Domino block and verifies 17), `-leavesL` trees of
at most L leaves (option max_leaves) and `-stepleavesN` N leaves shared by a step's trees
(option step_leaves; 0: no limit), e.g. `conditional-v2-vocab32768`, `chain-v2-m151936`
or `conditional-v2-stepleaves0`; `-graphreqsN` decode graphs for steps of up to N
requests (option graph_requests; 0: vLLM's capture sizes alone).

Round costs do not depend on weight values (accept lengths do), so the target is a
random model of the shape (Qwen3-4B: 36 layers, hidden 2560, vocab 151936; Qwen3-8B:
hidden 4096, for --tensor-parallel-size 2 on two GPUs) and the
drafters are random DFlash / Domino b16 checkpoints of the released shapes; a random
drafter accepts next to nothing, so every round commits about one token. Per method and
batch size, after a warm-up batch: ms per round = the batch's decode time (first to last
token) / rounds, where rounds come from vLLM's spec-decode counters (AR: tokens - 1); the
median of --repeats runs of the same batch (their range is recorded: single readings
moved by up to 1.7x between device calls on the H200).
For the plugin's methods a second pass with the stage clock on (engine/profiling.py)
splits a round into prepare (the step's trees described), verify (target forward),
accept, draft (drafter backbone), build (trees) and the rest (the stage clock's syncs
make that pass slower; its split, not its total, is what it is for), and a third pass
traces the worker's CUDA API calls (profiling.LaunchTrace): graph replays, eager kernel
launches, host waits and the host's milliseconds inside each stage per step, and the
GPU's kernel milliseconds per round and per stage. vLLM's own methods get that kernel
time too, from a traced pass through a worker extension of the benchmark's
(profiling.KernelTraceExtension, vLLM's `worker_extension_cls`): kernel ms per round
against ms per round says how much of each round the GPU computes.
The projection multiplies the paper's accept lengths (Qwen3-4B, 8 sets) by AR's step
time over each method's round time: a projection, not a measurement.

Every method runs in its own Python process with vLLM's defaults (the V2 runner and its
graph modes for `ar` and `dflash`; `dflash-v1` is vLLM's DFlash on its V1 runner, which
the plugin extends; `chain-v2`, `conditional-v2`, `marginal-v2` are the plugin's methods
on vLLM's V2 runner, option model_runner "v2", measured as vLLM's own methods are, with
the GPU's kernel time split by the stages that runner names: verify, prepare, sample,
accept, commit, draft),
so nothing one engine sets can reach another. Writes
round_cost.json and round_cost.md under --out after every method, over every method
whose rows are in --out (rows-METHOD.json, each with the command that made it): calls
with other --methods and the same --out add to one table (a device call of 9 minutes
fits two or three methods; use a new --out for a new table).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from harness import spec_counters  # benchmarks/ is this script's folder
from results_io import command_line, write_results
from variants import split_suffixes

SHAPES = {
    "qwen3-4b": dict(
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        draft_layers=5,
        gru=1024,
        emb=256,
    ),
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=512,
        draft_layers=1,
        gru=16,
        emb=8,
    ),
}
# Qwen3-8B, the shape tensor parallelism is measured on: Qwen3-4B's layers and heads, wider.
SHAPES["qwen3-8b"] = SHAPES["qwen3-4b"] | {"hidden_size": 4096, "intermediate_size": 12288}
BLOCK_SIZE = 16
PLUGIN_METHODS = ("chain", "marginal", "conditional")
# A plugin method on vLLM's V2 runner (`chain-v2`, `conditional-v2`): measured as vLLM's own
# methods are (that runner keeps no tree stats yet), its kernels split by stage.
V2 = "-v2"
# vLLM's worker extension that traces the baselines' kernels (engine/profiling.py).
KERNEL_TRACE = "vllm_dominotree.engine.profiling.KernelTraceExtension"

# Method suffix -> (engine arguments, environment) of the variant.
VARIANTS = {
    "-sync": ({"async_scheduling": False}, {}),
    "-vllm-draft": ({}, {"DOMINOTREE_DRAFT_GRAPHS": "0"}),
    "-prepare-apart": ({}, {"DOMINOTREE_PREPARE_IN_BUILD": "0"}),
    "-paths": ({}, {"DOMINOTREE_CUDA_TREE_ATTENTION": "paths"}),
    "-fixup": ({}, {"DOMINOTREE_CUDA_TREE_ATTENTION": "fixup"}),
    "-one-pass": ({}, {"DOMINOTREE_CUDA_TREE_ATTENTION": "one-pass"}),
    "-one-pass-fixup": ({}, {"DOMINOTREE_CUDA_TREE_ATTENTION": "one-pass-fixup"}),
    "-one-pass-merge": ({}, {"DOMINOTREE_CUDA_TREE_ATTENTION": "one-pass-merge"}),
    "-triton": ({}, {"DOMINOTREE_NODE_STEP": "triton"}),
    "-torch-step": ({}, {"DOMINOTREE_NODE_STEP": "torch"}),
    "-accept-torch": ({}, {"DOMINOTREE_ACCEPT_KERNEL": "torch"}),
    "-splits1": ({}, {"DOMINOTREE_PATH_SPLITS": "1"}),
    "-graphs1088": ({"max_cudagraph_capture_size": 1088}, {}),
}


# What the traced pass counts per step (engine/profiling.py), for every method.
STEP_COUNTS = ("graph_launches", "kernel_launches", "host_waits", "memcpy_async")
# A variant's environment variable -> the engine stat that names what the engine ran.
VARIANT_STATS = {
    "DOMINOTREE_NODE_STEP": "scorer_step",
    "DOMINOTREE_ACCEPT_KERNEL": "accept_kernel",
    "DOMINOTREE_CUDA_TREE_ATTENTION": "tree_attention",
    "DOMINOTREE_PATH_SPLITS": "path_splits",
}


def counts_per_step(trace: dict, steps: int) -> dict:
    """A traced pass's counts per step (a step is a round: the batch's requests share it)."""
    return {
        "per_step": {k: trace[k] / steps for k in STEP_COUNTS},
        "host_waits_by_scope": {k: v / steps for k, v in trace["host_waits_by_scope"].items()},
    }


def check_variant_ran(method: str, environment: dict[str, str], stats: dict) -> None:
    """A variant that did not take effect in the engine must not pass as measured."""
    options = split_options(method)[1]
    draft_vocab = options.get("draft_vocab", 0)
    if stats.get("draft_vocab", 0) != draft_vocab:
        raise RuntimeError(
            f"{method}: the engine drafted from {stats.get('draft_vocab')} tokens, not "
            f"the {draft_vocab} asked for"
        )
    for option in ("candidates", "budget", "max_leaves", "step_leaves"):
        if option in options and stats.get(option) != options[option]:
            raise RuntimeError(
                f"{method}: the engine ran {option} {stats.get(option)}, not the "
                f"{options[option]} asked for"
            )
    for variable, stat in VARIANT_STATS.items():
        asked = environment.get(variable)
        if asked and stats.get(stat) != asked:
            raise RuntimeError(
                f"{method}: the engine ran {stat} {stats.get(stat)!r}, not the {asked!r} "
                f"that {variable} asks for"
            )


def tree_fields(method: str, environment: dict[str, str], stats: dict) -> dict:
    """What a plugin engine's report (either runner's) says it ran, checked against the
    variant asked for, and the trees' shape so far: one pass runs an FA3 request per
    root-to-leaf path, so its cost grows with the leaves (random drafters grow bushy
    trees), and a step with a request that is not a tree runs the stock pass too."""
    check_variant_ran(method, environment, stats)
    fields = {stat: stats.get(stat, "") for stat in VARIANT_STATS.values()}
    fields["mean_leaves"] = stats.get("mean_leaves", "")
    fields["step_leaves"] = stats.get("step_leaves", "")  # the leaves a step's trees share
    # Host work outside vLLM's graphs so far (V2: builds by the builder's own graph or
    # eager, step descriptions gathered eagerly), in the JSON rows.
    for stat in ("graph_builds", "eager_builds", "eager_descriptions"):
        fields[stat] = stats.get(stat, "")
    steps = stats.get("steps", 0)
    one_pass = stats.get("one_pass_steps")
    fields["one_pass_share"] = one_pass / steps if steps and one_pass is not None else ""
    return fields


def split_variants(method: str) -> tuple[str, dict, dict]:
    """'conditional-sync-vllm-draft' -> ('conditional', engine arguments, environment)."""
    return split_suffixes(split_options(method)[0], VARIANTS)


# A method's last suffixes, in any order -> the speculative config's option they set.
OPTION_SUFFIXES = {
    "vocab": "draft_vocab",
    "m": "candidates",
    "b": "budget",
    "leaves": "max_leaves",
    "stepleaves": "step_leaves",
    "graphreqs": "graph_requests",
}


def split_options(method: str) -> tuple[str, dict[str, int]]:
    """'chain-v2-vocab32768-m64' -> ('chain-v2', {'draft_vocab': 32768, 'candidates': 64})."""
    options = {}
    while match := re.fullmatch(r"(.+)-(vocab|m|b|leaves|stepleaves|graphreqs)(\d+)", method):
        method, options = match[1], {OPTION_SUFFIXES[match[2]]: int(match[3]), **options}
    return method, options


# Overall accept lengths of the paper's table (Qwen3-4B, T = 0): the method whose round
# each one pays for.
PAPER_TAU = {
    "dflash": ("DFlash", 6.25),
    "dflash-v1": ("DFlash", 6.25),
    "marginal": ("DDTree (16)", 7.03),
    "chain": ("Domino", 7.17),
    "conditional": ("DominoTree (16)", 7.98),
}


def write_models(root: Path, shape: str, device: str) -> dict[str, str]:
    """Random target (HF folder), random Domino and DFlash drafters (released format),
    under root/shape."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from vllm_dominotree.drafter import read_spec
    from vllm_dominotree.drafter.checkpoint import write_checkpoint
    from vllm_dominotree.training.trainer import drafter_config

    sizes = dict(SHAPES[shape])
    layers, gru, emb = sizes.pop("draft_layers"), sizes.pop("gru"), sizes.pop("emb")
    # A folder per shape: later calls on the machine reuse what is there.
    dirs = {name: root / shape / name for name in ("target", "domino", "dflash")}
    if all((d / "config.json").is_file() for d in dirs.values()):
        write_random_ranking(dirs["domino"], sizes["vocab_size"])
        return {k: str(v) for k, v in dirs.items()}
    config = Qwen3Config(
        **sizes,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    torch.manual_seed(0)
    with torch.device(device):
        target = Qwen3ForCausalLM(config).to(torch.bfloat16)
    target.save_pretrained(dirs["target"])

    domino = drafter_config(
        config,
        block_size=BLOCK_SIZE,
        layers=layers,
        target_layers=layers,
        gru=gru,
        emb=emb,
        mask_token_id=config.vocab_size - 1,
    )
    domino["torch_dtype"] = "bfloat16"
    dflash = json.loads(json.dumps(domino))
    for key in ("projector_type", "gru_hidden_dim", "emb_dim", "pure_draft_prefix_len"):
        del dflash["dflash_config"][key]
    dflash["dflash_config"]["shift_label"] = False
    for name, cfg in (("domino", domino), ("dflash", dflash)):
        dirs[name].mkdir(parents=True, exist_ok=True)
        (dirs[name] / "config.json").write_text(json.dumps(cfg))
        shapes = read_spec(dirs[name]).expected_shapes()
        tensors = {
            n: (torch.ones(s) if n.endswith("norm.weight") else 0.02 * torch.randn(s))
            for n, s in shapes.items()
        }
        write_checkpoint(dirs[name], cfg, {n: t.to(torch.bfloat16) for n, t in tensors.items()})
    write_random_ranking(dirs["domino"], config.vocab_size)
    return {k: str(v) for k, v in dirs.items()}


def write_random_ranking(drafter_dir: Path, vocab: int) -> None:
    """The random drafter's token ranking for `-vocabS` (a random order: costs do not
    depend on which tokens a draft vocabulary holds), if it has none yet."""
    from vllm_dominotree.drafter.draft_vocab import has_ranking, write_ranking

    if not has_ranking(drafter_dir):
        write_ranking(
            drafter_dir, torch.randperm(vocab, generator=torch.Generator().manual_seed(0))
        )


def speculative_config(
    method: str, dirs: dict[str, str], options: dict | None = None
) -> dict | None:
    """The engine's speculative config for a method without its variants' suffixes, with
    the options of its last suffixes (split_options)."""
    if method == "ar":
        return None
    if method in ("dflash", "dflash-v1"):
        return {
            "method": "dflash",
            "model": dirs["dflash"],
            "num_speculative_tokens": BLOCK_SIZE - 1,
        }
    scorer = method.removesuffix(V2)
    # CUDA's budgets on every device (the CPU's default is smaller): the paper's tree of
    # 16, the chain of DFlash's block - 1 drafts.
    budget = BLOCK_SIZE - 1 if scorer == "chain" else 16
    config = {"method": "dominotree", "model": dirs["domino"], "budget": budget, "scorer": scorer}
    config |= options or {}
    if method.endswith(V2):  # vLLM's V2 runner (CUDA: it needs Triton)
        config["model_runner"] = "v2"
    return config


def timed_batch(
    llm, batch: int, tokens: int, vocab: int, prompt_tokens: int, seed: int
) -> tuple[float, float]:
    """(decode seconds of the batch, rounds per request) for `batch` random prompts of
    `prompt_tokens` tokens."""
    from vllm import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    prompts = [
        {"prompt_token_ids": torch.randint(0, vocab - 1, (prompt_tokens,), generator=gen).tolist()}
        for _ in range(batch)
    ]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    before = spec_counters(llm)[0]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    drafts = spec_counters(llm)[0] - before
    first = min(o.metrics.first_token_ts for o in outputs)
    last = max(o.metrics.last_token_ts for o in outputs)
    rounds = drafts / batch if drafts else tokens - 1
    return last - first, rounds


def per_round_kernels(top: dict[str, list[dict]], rounds: int) -> dict[str, list[dict]]:
    """A traced pass's top kernels per stage, their calls and milliseconds per round."""
    return {
        stage: [
            {"kernel": k["kernel"], "calls": k["calls"] / rounds, "ms": k["ms"] / rounds}
            for k in kernels
        ]
        for stage, kernels in top.items()
    }


def write_trace_tables(path: Path, trace: dict) -> None:
    """The profiler's tables of the traced pass (a worker of an earlier version of the
    plugin returns none: nothing is written then)."""
    if "host_ops" in trace:
        staged = [
            f"{stage}: {k['calls']} x {k['kernel']}, {k['ms']:.3f} ms"
            for stage, kernels in trace.get("top_kernels_by_stage", {}).items()
            for k in kernels
        ]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            f"host ops by self time\n{trace['host_ops']}\n\n"
            f"kernels by self time\n{trace['kernels']}\n\n"
            "kernels by stage (the whole traced pass)\n" + "\n".join(staged) + "\n"
        )


def run_method(method: str, dirs: dict[str, str], args) -> list[dict]:
    from vllm import LLM

    base, variant, environment = split_variants(method)  # the parent sets the environment
    # The engine's start (compilation, graph capture) costs device time per method, and a
    # user waits for it at every `vllm serve`: the chain's took ~4 minutes on the H100,
    # DFlash's ~1 (2026-12-06e, read from vLLM's log).
    started = time.perf_counter()
    llm = LLM(
        model=dirs["target"],
        skip_tokenizer_init=True,
        dtype="bfloat16",
        seed=0,
        # Room for the prompt, the answer and a verification's rows past its end.
        max_model_len=max(1024, args.prompt_tokens + args.tokens + 128),
        max_num_seqs=max(args.batches),
        disable_log_stats=False,
        speculative_config=speculative_config(base, dirs, split_options(method)[1]),
        enforce_eager=args.enforce_eager,
        # vLLM's JIT kernel warm-up only costs start-up time (~30 s on the H200).
        kernel_config={"enable_jit_warmup": False},
        worker_extension_cls="" if base in PLUGIN_METHODS else KERNEL_TRACE,
        tensor_parallel_size=args.tensor_parallel_size,
        **variant,
    )
    start_s = time.perf_counter() - started
    # What the engine was built with (every traced figure below is rank 0's).
    tensor_parallel_size = llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size
    # The largest step the engine captured: vLLM's 512 tokens, or the plugin's decode steps
    # of up to graph_requests trees (graph_sizes.py), or a -graphs1088 variant's.
    graph_tokens = llm.llm_engine.vllm_config.compilation_config.max_cudagraph_capture_size
    vocab = SHAPES[args.shape]["vocab_size"]
    rows = []
    try:
        for batch in args.batches:
            timed_batch(llm, batch, 8, vocab, args.prompt_tokens, seed=1)  # warm-up
            # The same batch `repeats` times (same prompts, so the same rounds): the
            # median is the figure, the runs say how much one reading can move.
            runs = [
                timed_batch(llm, batch, args.tokens, vocab, args.prompt_tokens, seed=2)
                for _ in range(args.repeats)
            ]
            rounds = runs[0][1]
            ms_runs = [1e3 * seconds / r for seconds, r in runs]
            row = {
                "method": method,
                "batch": batch,
                "shape": args.shape,
                "tensor_parallel_size": tensor_parallel_size,
                "prompt_tokens": args.prompt_tokens,
                "rounds": rounds,
                "accept_length": (args.tokens - 1) / rounds,
                "ms_per_round": statistics.median(ms_runs),
                "ms_per_round_runs": ms_runs,
                "engine_start_s": start_s,
                "graph_tokens": graph_tokens or 0,
            }
            if base not in PLUGIN_METHODS and not args.no_split:
                # vLLM's own methods and the plugin's on V2: the GPU's kernel time (their
                # workers carry the benchmark's trace extension) and the host's, by stage:
                # the plugin's V2 stages, and vLLM's runners labelled at the same points
                # (verify: the target's forward, sample, draft: the drafter's propose).
                llm.collective_rpc("kernel_trace", args=(True,))
                _, traced = timed_batch(llm, batch, args.tokens, vocab, args.prompt_tokens, seed=2)
                trace = llm.collective_rpc("kernel_trace", args=(False,))[0]
                row["kernel_ms_per_round"] = trace["kernel_ms"] / traced
                row |= counts_per_step(trace, traced)  # like the plugin's rows
                row["kernel_ms_per_round_by_stage"] = {
                    k: v / traced for k, v in trace["kernel_ms_by_stage"].items()
                }
                row["host_ms_per_round_by_stage"] = {
                    k: v / traced for k, v in trace["host_ms"].items()
                }
                row["top_kernels_per_round_by_stage"] = per_round_kernels(
                    trace["top_kernels_by_stage"], traced
                )
                write_trace_tables(args.out / "trace_tables" / f"{method}_b{batch}.txt", trace)
            if base.endswith(V2):  # the plugin's report on V2 (its figures so far)
                row |= tree_fields(method, environment, llm.collective_rpc("dominotree_stats")[0])
            if base in PLUGIN_METHODS and not args.no_split:
                llm.collective_rpc("dominotree_profile", args=(True,))
                _, rounds = timed_batch(llm, batch, args.tokens, vocab, args.prompt_tokens, seed=2)
                stats = llm.collective_rpc("dominotree_stats")[0]
                row["async_scheduling"] = stats.get("async_scheduling", False)
                row["graph_drafts"] = stats.get("graph_drafts", 0)  # query passes replayed
                row["prepared_in_build"] = stats.get("prepared_in_build", 0)
                row |= tree_fields(method, environment, stats)
                row["fixup_rounding"] = stats.get("fixup_rounding", "")
                stages = stats["stage_seconds"]
                llm.collective_rpc("dominotree_profile", args=(False,))
                split = {k: 1e3 * v / rounds for k, v in stages.items()}
                split["rest"] = split.pop("step") - sum(split.values())
                row["profiled_ms"] = split
                llm.collective_rpc("dominotree_trace", args=(True,))
                _, traced = timed_batch(llm, batch, args.tokens, vocab, args.prompt_tokens, seed=2)
                trace = llm.collective_rpc("dominotree_trace", args=(False,))[0]
                steps = max(1, trace["steps"])
                row |= counts_per_step(trace, steps)
                row["host_ms_per_step"] = {
                    k: v / steps for k, v in trace.get("host_ms", {}).items()
                }
                row["per_step_by_stage"] = {
                    stage: {k: v / steps for k, v in counts.items()}
                    for stage, counts in trace.get("launches_by_stage", {}).items()
                }
                # The GPU's kernel milliseconds per round (against ms_per_round: whether
                # the GPU or the host sets the round), and per stage.
                row["kernel_ms_per_round"] = trace["kernel_ms"] / traced
                row["kernel_ms_per_round_by_stage"] = {
                    k: v / traced for k, v in trace["kernel_ms_by_stage"].items()
                }
                row["top_kernels_per_round_by_stage"] = per_round_kernels(
                    trace.get("top_kernels_by_stage", {}), traced
                )
                row["trace_calls"] = trace["calls"]
                write_trace_tables(args.out / "trace_tables" / f"{method}_b{batch}.txt", trace)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return rows


def gathered_rows(out: Path) -> list[dict]:
    """Every method's rows under `out`, in the order the methods finished (this call's
    and earlier calls')."""
    files = sorted(out.glob("rows-*.json"), key=lambda f: f.stat().st_mtime_ns)
    return [row for f in files for row in json.loads(f.read_text())]


def trees_cell(row: dict) -> str:
    """The tree attention a plugin row ran, its trees' mean leaves (and the leaves a
    step's trees share, where limited) and the share of its steps that ran one pass ("-"
    for rows without trees)."""
    if not row.get("tree_attention"):
        return "-"
    cell = f"{row['tree_attention']}, {row['mean_leaves']:.1f} leaves"
    if row.get("step_leaves"):
        cell += f" ({row['step_leaves']} a step)"
    share = row.get("one_pass_share")
    return cell + (f", {share:.0%} one pass" if share != "" else "")


def verify_vs_dflash(row: dict, rows: list[dict]) -> float | None:
    """The row's verification against vLLM dflash's at the same batch: GPU kernel ms in
    the "verify" stage (the target's forward; vLLM's runner labelled alike while traced),
    None where either was not traced on a GPU."""
    dflash = next((r for r in rows if r["method"] == "dflash" and r["batch"] == row["batch"]), {})
    theirs = dflash.get("kernel_ms_per_round_by_stage", {}).get("verify")
    ours = row.get("kernel_ms_per_round_by_stage", {}).get("verify")
    return ours / theirs if ours and theirs else None


def report(rows: list[dict], args) -> None:
    ar = {r["batch"]: r["ms_per_round"] for r in rows if r["method"] == "ar"}
    for r in rows:
        base = split_variants(r["method"])[0]
        if base.removesuffix(V2) in PAPER_TAU and r["batch"] in ar:
            name, tau = PAPER_TAU[base.removesuffix(V2)]
            speedup = tau * ar[r["batch"]] / r["ms_per_round"]
            r["projection"] = {
                "paper_method": name,
                "paper_accept_length": tau,
                "projected_speedup": speedup,
            }
    dflash = {r["batch"]: r["ms_per_round"] for r in rows if r["method"] == "dflash"}
    table = []
    for r in rows:
        split = r.get("profiled_ms", {})
        cells = [
            f"{split[k]:.2f}" if k in split else "-"
            for k in ("prepare", "verify", "accept", "draft", "build", "rest")
        ]
        step = r.get("per_step", {})
        cells += [
            f"{step[k]:.1f}" if k in step else "-"
            for k in ("graph_launches", "kernel_launches", "host_waits")
        ]
        waits = r.get("host_waits_by_scope", {})
        cells.append(", ".join(f"{k} {v:.1f}" for k, v in sorted(waits.items())) or "-")
        host = r.get("host_ms_per_step", {})
        cells.append(", ".join(f"{k} {v:.2f}" for k, v in sorted(host.items())) or "-")
        gpu = r.get("kernel_ms_per_round_by_stage", {})
        cells.append(
            f"{r['kernel_ms_per_round']:.2f}"
            + "".join(f", {k} {v:.2f}" for k, v in sorted(gpu.items()))
            if "kernel_ms_per_round" in r
            else "-"
        )
        by_stage = r.get("per_step_by_stage", {})
        cells.append(
            ", ".join(
                f"{k} {v.get('kernel_launches', 0):.0f}/{v.get('torch_ops', 0):.0f}"
                for k, v in sorted(by_stage.items())
            )
            or "-"
        )
        cells.append(trees_cell(r))
        ratio = r["ms_per_round"] / dflash[r["batch"]] if r["batch"] in dflash else None
        cells.append(f"{ratio:.2f}x" if ratio else "-")
        verify = verify_vs_dflash(r, rows)
        cells.append(f"{verify:.2f}x" if verify else "-")
        proj = r.get("projection")
        proj_cell = (
            (
                f"{proj['projected_speedup']:.2f}x ({proj['paper_method']}, "
                f"tau {proj['paper_accept_length']})"
            )
            if proj
            else "-"
        )
        scheduling = {True: "async", False: "sync"}.get(r.get("async_scheduling"), "-")
        runs = r.get("ms_per_round_runs", [r["ms_per_round"]])
        ms = f"{r['ms_per_round']:.2f} ({min(runs):.2f}-{max(runs):.2f})"
        start = f"{r['engine_start_s']:.0f}" if "engine_start_s" in r else "-"
        table.append([r["method"], r["batch"], scheduling, ms, *cells, proj_cell, start])
    header = [
        "method",
        "batch",
        "scheduling",
        "ms/round (median, runs' range)",
        "prepare",
        "verify",
        "accept",
        "draft",
        "build",
        "rest",
        "graphs/step",
        "eager launches/step",
        "host waits/step",
        "host waits/step by scope",
        "host ms/step by stage (traced)",
        "GPU kernel ms/round, by stage (traced)",
        "eager launches / torch ops per step by stage (traced)",
        "trees: attention, mean leaves, one-pass steps",
        "vs dflash",
        "verify vs dflash's (GPU kernel ms)",
        "projected speedup (paper tau)",
        "engine start s",
    ]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    intro = [
        f"# Round cost on {device}",
        "",
        "; ".join(f"`{c}`" for c in dict.fromkeys(r.get("command", "") for r in rows))
        + f"; random {args.shape}-shaped target and drafters, "
        + (
            f"tensor parallelism {args.tensor_parallel_size}, "
            if args.tensor_parallel_size > 1
            else ""
        )
        + f"prompts of {args.prompt_tokens} tokens, "
        f"{args.tokens} tokens per request, ms per round (verify .. rest: the stage "
        "clock's split, with syncs; graphs / eager launches / host waits per "
        "verification step from a traced pass).",
    ]
    write_results(
        args.out,
        "round_cost",
        {"command": vars(args), "device": device, "rows": rows},
        header,
        table,
        intro,
    )


MODELS = "models"  # the child that writes the random models
# What one table holds one of (rows written before a field was recorded: its default).
TABLE_KEYS = {"shape": "qwen3-4b", "tensor_parallel_size": 1, "prompt_tokens": 128}


def check_one_table(rows: list[dict], args) -> None:
    """Rows already under --out were measured on the shape, tensor parallelism and prompt
    length asked for now: one table compares like with like."""
    for key, default in TABLE_KEYS.items():
        found = {row.get(key, default) for row in rows}
        asked = getattr(args, key)
        if found - {asked}:
            raise SystemExit(
                f"{args.out} holds rows measured with {key} {sorted(found)}, not {asked}: "
                "one table has one of each; use another --out"
            )


def wait_for_idle_gpu(limit_s: float = 120.0) -> None:
    """Until no process holds the GPU (a killed engine's process may outlive its parent
    by seconds), or the limit passes; without nvidia-smi (CPU), at once."""
    if shutil.which("nvidia-smi") is None:
        return
    deadline = time.monotonic() + limit_s
    query = ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"]
    while subprocess.run(query, capture_output=True, text=True).stdout.strip():
        if time.monotonic() > deadline:
            raise SystemExit("the GPU is still held by another process; stop it first")
        time.sleep(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen3-4b")
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="every engine's (vLLM's tensor_parallel_size): that many GPUs",
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["ar", "dflash", "dflash-v1", "chain", "marginal", "conditional"],
    )
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=128,
        help="each prompt's length: the prefix every verification attends over (tree rows "
        "through FA3 path requests read it once per root-to-leaf path)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per batch (median)")
    parser.add_argument("--models", type=Path, help="where the random models go (default: --out)")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument(
        "--no-split",
        action="store_true",
        help="the unprofiled round only (no stage-clock or traced pass: a shorter call)",
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one method here
    args = parser.parse_args()
    models = args.models or args.out / "models"
    args.out.mkdir(parents=True, exist_ok=True)
    if args.one == MODELS:  # a child process: the random models (on the GPU if any)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        dirs = write_models(models, args.shape, device)
        (models / args.shape / "dirs.json").write_text(json.dumps(dirs))
        return
    if args.one:  # a child process: one engine, its rows as JSON
        dirs = json.loads((models / args.shape / "dirs.json").read_text())
        rows = run_method(args.one, dirs, args)
        (args.out / f"rows-{args.one}.json").write_text(json.dumps(rows))
        return
    # This process never touches the GPU: every engine needs all of its memory, so the
    # models and each method get a process of their own, started once the last one's
    # engine has let go of the GPU.
    check_one_table(gathered_rows(args.out), args)
    started = time.perf_counter()
    for method in [MODELS, *args.methods]:
        env = dict(os.environ)
        env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        # vLLM's V1 runner names its phases as profiler ranges, so the trace can say which
        # of them waits on the device (host_waits_by_scope); off the trace, a few
        # microseconds per step, the same for every method.
        env["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"
        if method == "dflash-v1":
            env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        env |= split_variants(method)[2]
        wait_for_idle_gpu()
        child = [sys.executable, __file__, "--one", method, *sys.argv[1:]]
        subprocess.run(child, env=env, check=True)
        if method == MODELS:
            print(f"models ready in {time.perf_counter() - started:.1f} s", flush=True)
            continue
        done = args.out / f"rows-{method}.json"
        rows = [row | {"command": command_line()} for row in json.loads(done.read_text())]
        done.write_text(json.dumps(rows))
        report(gathered_rows(args.out), args)
    print((args.out / "round_cost.md").read_text())


if __name__ == "__main__":
    main()
