"""The DominoTree options a user sets, validated into one frozen object.

The same keys are accepted in vLLM's `--speculative-config` JSON beside "method" and
"model"; unknown keys and bad values fail with a message naming the key and the fix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from .drafter.checkpoint import DrafterSpec
from .drafter.score_temperature import check_temperature
from .tree.builder import TreeShape

SCORERS = ("conditional", "marginal", "chain")
MODEL_RUNNERS = ("v1", "v2")
# The node budget when the user sets none, per device. CUDA: 16, the paper's. CPU: the
# target is compute-bound, so every verification row costs about 3.6 ms beside a 61 ms
# step of SmolLM2-135M on 2 cores, and budgets 2-4 were the only ones near parity
# (benchmarks/results/smollm2_cpu_budgets.md).
CPU_BUDGET = 4


def cpu_step_nodes(budget: int) -> int:
    """The nodes a step's trees share when the user sets none, on CPU (the tree runner):
    the budget, so a lone request's tree keeps it and a step of p padded rows gives each
    tree budget // p (at least one): a batch verifies about as many rows as one request.
    With three requests in one batch, the shipped SmolLM2 pair at budget 4 ran at 0.89x /
    0.95x of plain decoding with one node a tree, 0.85x / 0.93x with two and 0.79x /
    0.81x with four, one request at a time unchanged (float32, two runs, a 2-core EPYC:
    benchmarks/results/cpu_2026-12-08_step_nodes/). CUDA: none (speculative.py refuses
    it there)."""
    return budget


# The draft vocabulary when the user sets none and the drafter ships a token ranking
# (drafter/draft_vocab.py), per device. CPU: with SmolLM2's shipped pair at budget 4 in
# bfloat16, 8192 tokens cut the build stage from 7.0 to 3.8 ms a step and kept the accept
# length (1.000x, 0.998-1.002): 1.12x over no speculation against 1.08x with the whole
# vocabulary and 1.07x with 16384 (benchmarks/results/draft_vocab_cpu.md). CUDA: the
# whole vocabulary. 32768 of Qwen3's tokens take 0.16 ms off a batch-1 round and 0.5 ms
# off a batch-16 one (H100, benchmarks/results/h100_2026-12-06c/), but what they cost a
# trained drafter's accept length there is not measured, and released drafters ship no
# ranking. It runs there losslessly (tests/gpu/test_engine_gpu.py, H200 2026-12-06b).
CPU_DRAFT_VOCAB = 8192


class DominoTreeConfigError(ValueError):
    pass


CUDA_TREE_ATTENTION_MODES = (
    "auto",
    "fixup",
    "paths",
    "one-pass",
    "one-pass-fixup",
    "one-pass-merge",
)


def attention_mode() -> str:
    """How CUDA tree rows are recomputed (engine/cuda_attention.py), from the environment's
    DOMINOTREE_CUDA_TREE_ATTENTION: "one-pass" (a step whose requests are all trees runs
    FA3 once, over path requests that hold every row, in place of the stock pass; other
    steps run as "paths"), "paths" (the stock pass, then FA3 over path requests for the
    rows it got wrong, engine/tree_paths.py), "fixup" (the stock pass, then the Triton
    tree kernel for those rows: any backend; beside FA3 in FA3's steps,
    kernels/tree_attention_fa3.py), "one-pass-fixup" (as one-pass, every row of an
    all-tree step by the fix-up's kernel), "one-pass-merge" (as one-pass, but an all-tree
    step runs FA3 once per request over its prefix alone and a Triton kernel for the
    tree's own rows, merged by log-sum-exp: kernels/tree_merge.py; each prefix read once,
    where a path request per leaf reads it once a leaf), or "auto" (default): one pass where the
    target runs FA3, else fixup. Path requests round each row as decoding its own path
    would: in bfloat16 the fix-up's own rounding left SmolLM2-135M's greedy output on 64
    of 100 prompts where vLLM's DFlash left it on 1-3 and the path requests on 0-4 (H200,
    benchmarks/results/h200_2026-12-02_bf16, h200_2026-12-03e). One pass over two: 0.62
    / 0.48 ms less verification per round at batch 1 / 16 (h200_2026-12-03e)."""
    mode = os.environ.get("DOMINOTREE_CUDA_TREE_ATTENTION", "auto")
    if mode not in CUDA_TREE_ATTENTION_MODES:
        raise ValueError(
            f"dominotree: DOMINOTREE_CUDA_TREE_ATTENTION={mode!r}; "
            f"use one of {CUDA_TREE_ATTENTION_MODES}"
        )
    return mode


def path_splits() -> int | None:
    """How many key splits FA3 takes for the path requests (engine/cuda_attention.py),
    from the environment's DOMINOTREE_PATH_SPLITS: "vllm" (default: as vLLM calls the
    stock pass, 32 under FULL graphs, FA3's own choice elsewhere) or a count >= 1. Why it
    is a choice: the path pass has as many requests as the forward has rows, and FA3
    keeps and combines that many partial outputs per split
    (benchmarks/tree_rounding_bench.py times both)."""
    value = os.environ.get("DOMINOTREE_PATH_SPLITS", "vllm")
    if value == "vllm":
        return None
    if not value.isdigit() or int(value) < 1:
        raise DominoTreeConfigError(
            f'dominotree: DOMINOTREE_PATH_SPLITS={value!r}; use "vllm" or a count >= 1'
        )
    return int(value)


KERNEL_CHOICES = ("torch", "triton")  # the switches below: torch code, or Triton kernels


def _kernel_switch(variable: str, default: str = "torch") -> str:
    """An environment switch between torch code and Triton kernels."""
    kind = os.environ.get(variable, default)
    if kind not in KERNEL_CHOICES:
        raise DominoTreeConfigError(f"dominotree: {variable}={kind!r}; use one of {KERNEL_CHOICES}")
    return kind


def node_step(scorer: str, candidates: int, width: int, cuda: bool) -> str:
    """How Domino's correction computes a node's children (tree/scorers.py: the
    conditional scorer's trees and Domino's chain, whose steps are the same calls), from the
    environment's DOMINOTREE_NODE_STEP: "triton" (two Triton launches per pop: the GRU,
    then u and the children with the builder's bookkeeping, kernels/domino_step.py and
    kernels/tree_pop.py) or "torch" (the torch step, compiled on CUDA). width: the
    drafter's logits the top M is taken of (its draft vocabulary, or all its tokens).

    The Triton step corrects a top-M restriction, so it needs candidates below width and
    CUDA: asked for without them it is refused (at engine start); by default it is what
    CUDA runs wherever it applies, the torch step elsewhere (CPU, whole-vocabulary
    candidates). The marginal scorer has no node step ("torch" here). Why the default: a
    budget-16 build in 0.98 / 1.46 / 3.64 ms at batch 1 / 16 / 64 against the torch
    step's 1.31 / 1.75 / 3.48 (H100, one run, benchmarks/results/h100_2026-12-05e: slower
    at batch 64 only), a batch-1 round in vLLM (V2) of 5.40 ms against 5.56 (H200,
    benchmarks/results/h200_2026-12-05b), and greedy float32 output equal to no
    speculation in the GPU engine tests on both runners (H100, 2026-12-06c). The chain
    takes it too since 2026-12-06e: two launches a draft (0.26 ms of a batch-1 round on
    V2, which cost what the chain compiled as one Inductor graph did, 5.87 against 5.89
    ms, and its engine started in 72 s against 147: H100, 2026-12-06f)."""
    variable = "DOMINOTREE_NODE_STEP"
    asked = _kernel_switch(variable) if variable in os.environ else None  # checked
    if asked == "triton" and not cuda:
        raise DominoTreeConfigError(
            "DOMINOTREE_NODE_STEP=triton runs the scorer's step as CUDA kernels; "
            "unset it (or set it to torch) on CPU"
        )
    corrected = scorer in ("conditional", "chain")
    restricted = corrected and candidates < width
    if asked == "triton" and corrected and not restricted:
        raise DominoTreeConfigError(
            f"DOMINOTREE_NODE_STEP=triton corrects a top-M restriction of the drafter's "
            f"{width} logits, but candidates is {candidates}: set candidates below "
            f"{width}, or unset DOMINOTREE_NODE_STEP"
        )
    if not corrected:
        return "torch"
    if asked is not None:
        return asked
    return "triton" if cuda and restricted else "torch"


def accept_kernel(cuda: bool) -> str:
    """How a step's trees are accepted (engine/acceptance.accept_step), from the
    environment's DOMINOTREE_ACCEPT_KERNEL: "triton" (the default on CUDA: one launch,
    kernels/tree_accept.py) or "torch" (the default on CPU, where Triton is refused:
    acceptance.accept_trees and step_counters, about 85 small kernels). On an H100 the
    kernel took the accept stage from 0.15 to 0.04 ms a round at batch 1 and from 0.24
    to 0.10 at batch 16, and equalled the torch reference inside the accept graphs
    (benchmarks/results/h100_2026-12-05d)."""
    return _kernel_switch("DOMINOTREE_ACCEPT_KERNEL", "triton" if cuda else "torch")


@dataclass(frozen=True)
class DominoTreeConfig:
    # Drafted nodes per tree (the verification pass checks budget + 1 rows).
    budget: int = 16
    # Candidate width M: the conditional scorer corrects only the marginal top-M tokens
    # of each depth (M >= vocabulary size means no restriction).
    candidates: int = 64
    # conditional = DominoTree, marginal = DDTree, chain = the released single path.
    scorer: str = "conditional"
    # Children a node may get; None = budget (no limit beyond the budget).
    max_children: int | None = None
    # Leaves (root-to-leaf paths) a tree may have; 0 = no limit. Where the target runs
    # FA3, a tree is verified by one FA3 request per path, each reading the request's
    # prefix (the path requests, engine/tree_paths.py), so fewer paths should cost less
    # verification at large batches; once a tree has this many leaves, the build only
    # deepens them.
    max_leaves: int = 0
    # Leaves all the trees of a step may have together, shared evenly over its padded
    # rows: each tree at most max(1, step_leaves // rows), within max_leaves (tree/
    # builder.py, TreeShape.for_rows); 0 = no limit. Each leaf is a path request, so
    # a step's verification grows with its leaves: on an H100 (random Qwen3-4B-shaped
    # pair, benchmarks/results/h100_2026-12-07d/) a batch-16 round of 16-leaf trees took
    # 10.85 ms, of 4-leaf trees 8.85, against DFlash's 6.89, where at batch 1 the leaves
    # changed nothing (6.01 / 6.00). 64 leaves leave batches of up to 4 unlimited at
    # budget 16 and give batch 16 four leaves a tree (SmolLM2's drafter: accept 1.70
    # against 1.79 at budget 16 on the CPU).
    step_leaves: int = 64
    # Nodes all the trees of a step may have together, shared evenly over its padded
    # rows: each tree at most max(1, step_nodes // rows) nodes, within the budget; 0 = no
    # limit. The trees of a larger batch then verify fewer rows: on a CPU the target's
    # GEMMs are compute-bound at a few rows, so a batch's extra rows cost what a lone
    # request's do not. CPU and model_runner 'v1' only (speculative.py says why).
    step_nodes: int = 0
    # Grow the greedy path to full depth before branching, so that the tree always
    # contains the chain (see tree/builder.py). Costs depth's worth of budget.
    spine: bool = False
    # vLLM's model runner: "v1" (the tree runner) or "v2" (vLLM's default runner, whose
    # host work per step is a fraction of V1's, but whose trees refuse the sampling
    # features V1 serves: logprobs, penalties, ...; README's options table).
    model_runner: str = "v1"
    # The drafter's logits, top-M and correction cover only the `draft_vocab` most
    # frequent tokens of the drafter's ranking (drafter/draft_vocab.py); 0 = the whole
    # vocabulary. Lossless either way: a token outside it is never drafted.
    draft_vocab: int = 0
    # Decode steps of up to this many requests (and max_num_seqs) run inside CUDA graphs,
    # at the verification's rows and the drafter's block (graph_sizes.py): vLLM's own
    # capture stops at 512 tokens, 30 trees of 17 rows. 0 keeps vLLM's sizes; capture
    # sizes the user names are kept either way.
    graph_requests: int = 128
    # The trees' scores are the drafter's log-probs of logits / score_temperature: a
    # drafter's fitted value (drafter/score_temperature.py) where the user names none
    # (speculative.py), else 1. It shapes the trees only; output stays lossless.
    score_temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.scorer not in SCORERS:
            raise DominoTreeConfigError(
                f"scorer {self.scorer!r} is unknown; choose one of {', '.join(SCORERS)}"
            )
        for name in ("budget", "candidates"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise DominoTreeConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.budget > 64:
            raise DominoTreeConfigError(
                f"budget {self.budget} is over 64 nodes: every request verifies budget + 1 "
                "rows per step, and past 64 the extra rows cost more than they can accept; "
                "pick budget <= 64"
            )
        # Options whose 0 means "none": the whole vocabulary, no leaf limit.
        zeros = {
            "draft_vocab": "the whole vocabulary",
            "max_leaves": "no limit",
            "step_leaves": "no limit",
            "step_nodes": "no limit",
            "graph_requests": "vLLM's capture sizes",
        }
        for name, zero in zeros.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise DominoTreeConfigError(
                    f"{name} must be 0 ({zero}) or a positive integer, got {value!r}"
                )
        if self.model_runner not in MODEL_RUNNERS:
            raise DominoTreeConfigError(
                f"model_runner {self.model_runner!r} is unknown; choose one of "
                f"{', '.join(MODEL_RUNNERS)}"
            )
        try:
            check_temperature(self.score_temperature, "score_temperature")
        except ValueError as err:
            raise DominoTreeConfigError(
                f"{err}: the drafter's logits are divided by it before the trees' scores "
                "(1 = as the drafter gives them)"
            ) from None
        if not isinstance(self.spine, bool):
            raise DominoTreeConfigError(f"spine must be true or false, got {self.spine!r}")
        if self.max_children is not None and (
            not isinstance(self.max_children, int) or self.max_children < 1
        ):
            raise DominoTreeConfigError(
                f"max_children must be a positive integer or null, got {self.max_children!r}"
            )

    @classmethod
    def from_dict(cls, options: dict) -> DominoTreeConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise DominoTreeConfigError(
                f"unknown DominoTree option(s) {unknown}; known options: {sorted(known)}"
            )
        return cls(**options)

    def check_drafter(self, spec: DrafterSpec) -> None:
        if self.scorer == "conditional" and not spec.is_domino:
            raise DominoTreeConfigError(
                f"scorer 'conditional' needs a Domino checkpoint (dflash_config.projector_type "
                f"'domino'), but {spec.path} is a plain DFlash drafter; use scorer 'marginal' "
                "(DDTree) or 'chain' with it"
            )

    def tree_shape(self, num_drafts: int) -> TreeShape:
        """The builder's limits for a drafter with `num_drafts` drafts per block. A tree of
        `budget` nodes reaches depth `budget` at most, so the drafts past it are never
        scored (the proposer computes no logits for them). The chain is a path of
        `budget` nodes, or of the block's drafts where the budget is larger: the CPU's
        budget of 4 verifies 5 rows a step where the whole block's 16 drafts verified 17
        (about 110 ms a step against 59 at 3 rows for SmolLM2-135M on 2 cores), and a
        budget of 15 on CUDA verifies the 16 rows vLLM's DFlash does."""
        if self.scorer == "chain":
            length = min(num_drafts, self.budget)
            return TreeShape(
                budget=length, max_depth=length, max_children=1, step_nodes=self.step_nodes
            )
        return TreeShape(
            budget=self.budget,
            max_depth=min(num_drafts, self.budget),
            max_children=self.max_children or self.budget,
            spine=self.spine,
            max_leaves=self.max_leaves,
            step_leaves=self.step_leaves,
            step_nodes=self.step_nodes,
        )
