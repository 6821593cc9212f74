"""Accept lengths of draft trees along the target's own answers, offline (no engine).

    python benchmarks/tree_accept_bench.py --target DIR --drafter DIR \\
        --data data/smollm2/eval-sets-25.jsonl.xz --out OUT \\
        [--configs conditional-16 conditional-16-t1 marginal-16 marginal-16-t1] [--limit N]

For each response (the target's greedy answer) every anchor's block is drafted from the
target's features before it, teacher-forced as in training (training/trainer.py), and
each config's tree is built by the package's own scorer and host heap (tree/). A tree
accepts the longest root path whose tokens are the answer's next tokens. Greedy rounds
are then replayed as an engine runs them: the first round anchored at the answer's first
token (the prefill's), each next one after the accepted tokens and the bonus token. So
`accept length` is what a greedy engine with the same target and drafter would report on
these answers (up to the engine's rounding: this runs the target in float32); `every
position` is the mean over all anchors (training/evaluate.py's measure, above the
engine's).

Configs: SCORER-BUDGET with an optional -tT, the scores' temperature; without it, the
drafter's fitted one, as an engine takes it (drafter/score_temperature.py). Each
config's ratio is over its twin at T = 1 (`conditional-16` over `conditional-16-t1`)
where that is listed too (configs at T = 1 have none), else over the first config, with
paired bootstrap 95% intervals over responses.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch
from results_io import command_line, write_results  # benchmarks/ is this script's folder
from transformers import AutoModelForCausalLM

from vllm_dominotree.config import DominoTreeConfig
from vllm_dominotree.drafter.model import Drafter
from vllm_dominotree.drafter.score_temperature import default_temperature
from vllm_dominotree.evaluation.bootstrap import paired_bootstrap
from vllm_dominotree.training.evaluate import ANCHORS_PER_PASS, first_anchor
from vllm_dominotree.training.trainer import (
    Batch,
    block_hidden,
    load_sequences,
    target_features,
)
from vllm_dominotree.tree.builder import DraftTree, TreeShape, build_trees
from vllm_dominotree.tree.scorers import make_scorer


def parse_config(name: str, drafter_dir: str | Path) -> DominoTreeConfig:
    """'conditional-16-t1.4' -> its options; no -t: the drafter's fitted temperature."""
    match = re.fullmatch(r"(conditional|marginal)-(\d+)(?:-t(\d+(?:\.\d+)?))?", name)
    if match is None:
        raise ValueError(f"config {name!r}: SCORER-BUDGET[-tT], e.g. conditional-16-t1.4")
    scorer, budget, t = match[1], int(match[2]), match[3]
    temperature = float(t) if t else default_temperature(drafter_dir, scorer)
    return DominoTreeConfig(budget=budget, scorer=scorer, score_temperature=temperature)


def accepted(tree: DraftTree, truth: list[int]) -> int:
    """How many of truth's tokens the tree's longest matching root path holds."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(tree.parents[1:], start=1):
        children.setdefault(parent, []).append(node)
    node, count = 0, 0
    while count < len(truth):
        node = next((c for c in children.get(node, []) if tree.tokens[c] == truth[count]), None)
        if node is None:
            break
        count += 1
    return count


def greedy_rounds(per_anchor: list[int]) -> tuple[int, int]:
    """(tokens committed, rounds) of greedy rounds over a response's anchors (the first
    at the prompt's last token): the prefill samples the answer's first token, the first
    round is anchored there (anchor 1), and a round at anchor i commits its accepted
    drafts and the bonus, the next is anchored after them."""
    i, tokens, rounds = 1, 0, 0
    while i < len(per_anchor):
        tokens += per_anchor[i] + 1
        rounds += 1
        i += per_anchor[i] + 1
    return tokens, rounds


Builders = dict[str, tuple[TreeShape, object]]  # config name -> (tree shape, its scorer)


def tree_builders(target, drafter: Drafter, configs: dict[str, DominoTreeConfig]) -> Builders:
    """Each config's tree shape and scorer, made once and prepared for every chunk of
    anchors. The shape is a tree's whole (a step's `step_leaves` share is not taken): the
    trees of an engine serving one request at a time."""
    builders = {}
    for name, config in configs.items():
        shape = config.tree_shape(drafter.spec.num_drafts)
        scorer = make_scorer(
            config.scorer,
            drafter.head,
            target.get_input_embeddings().weight,
            shape=shape,
            candidates=config.candidates,
            prefix_len=drafter.spec.pure_draft_prefix_len,
            max_requests=ANCHORS_PER_PASS,
            temperature=config.score_temperature,
        )
        builders[name] = (shape, scorer)
    return builders


@torch.no_grad()
def response_accepts(
    target, drafter: Drafter, builders: Builders, tokens, prompt_len
) -> dict[str, list[int]]:
    """Per config, each anchor's accepted drafts along one response."""
    s = drafter.spec
    k = s.num_drafts
    ids, length = torch.tensor([tokens]), torch.tensor([len(tokens)])
    features = target_features(target, s.target_layer_ids, ids, length)
    lm_head = target.get_output_embeddings()
    first = first_anchor(prompt_len)
    out: dict[str, list[int]] = {name: [] for name in builders}
    positions = torch.arange(first, max(first, len(tokens) - k))  # none for short answers
    for chunk in positions.split(ANCHORS_PER_PASS) if len(positions) else ():
        batch = Batch(ids, length, chunk[None], torch.ones(1, len(chunk), dtype=torch.bool))
        hidden = block_hidden(target, drafter, batch, ids.device, features)[0]  # [A, K, H]
        base = lm_head(hidden)  # [A, K, V]
        anchors = [tokens[p] for p in chunk.tolist()]
        truths = [tokens[p + 1 : p + 1 + k] for p in chunk.tolist()]
        for name, (shape, scorer) in builders.items():
            scorer.prepare(hidden[:, : shape.max_depth], base[:, : shape.max_depth])
            trees = build_trees(scorer, anchors, shape)
            out[name] += [accepted(t, truth) for t, truth in zip(trees, truths, strict=True)]
    return out


def reference_of(name: str, names: list[str]) -> str:
    """The config a config is compared with: its twin at T = 1 if listed (a config at T = 1
    is its own: no ratio), else the first."""
    twin = re.sub(r"-t\d+(\.\d+)?$", "", name) + "-t1"
    return twin if twin in names else names[0]


def summarize(per_response: list[dict[str, list[int]]], names: list[str]) -> dict:
    """Accept lengths per config, and each one's ratio over its reference_of."""

    def rounds_accept(rows, name):
        tokens, rounds = map(sum, zip(*(greedy_rounds(r[name]) for r in rows), strict=True))
        return tokens / rounds

    summary = {}
    for name in names:
        anchors = [a for r in per_response for a in r[name]]
        summary[name] = {
            "accept_length": round(rounds_accept(per_response, name), 4),
            "every_position": round(1 + sum(anchors) / len(anchors), 4),
            "anchors": len(anchors),
        }
        reference = reference_of(name, names)
        if name != reference:
            ratio = rounds_accept(per_response, name) / rounds_accept(per_response, reference)
            low, high = paired_bootstrap(
                [{"r": r[name]} for r in per_response],
                [{"r": r[reference]} for r in per_response],
                lambda rows: rounds_accept(rows, "r"),
                samples=2000,
            )
            summary[name] |= {"over": reference, "ratio": round(ratio, 4), "ci95": [low, high]}
    return summary


def table_rows(summary: dict) -> list[list[object]]:
    rows = []
    for name, row in summary.items():
        ratio = "-"
        if "ratio" in row:
            low, high = row["ci95"]
            ratio = f"{row['ratio']:.3f}x over {row['over']} ({low:.3f}-{high:.3f})"
        rows.append([name, f"{row['temperature']:g}", f"{row['accept_length']:.3f}", ratio,
                     f"{row['every_position']:.3f}"])  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--drafter", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--configs", nargs="+", default=["conditional-16-t1", "conditional-16"])
    parser.add_argument("--limit", type=int, default=100, help="responses (the first N)")
    args = parser.parse_args()
    configs = {name: parse_config(name, args.drafter) for name in args.configs}
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    drafter = Drafter.load(str(args.drafter))
    sequences = load_sequences(args.data)[: args.limit]
    builders = tree_builders(target, drafter, configs)
    per_response = []
    for i, (tokens, prompt_len) in enumerate(sequences):
        per_response.append(response_accepts(target, drafter, builders, tokens, prompt_len))
        print(f"response {i + 1}/{len(sequences)}", flush=True)
    summary = summarize(per_response, args.configs)
    for name, config in configs.items():
        summary[name]["temperature"] = config.score_temperature
    print(json.dumps(summary, indent=1))
    write_results(
        args.out,
        "tree_accept",
        {"command": command_line(), "summary": summary, "per_response": per_response},
        ["config", "temperature", "accept length (greedy rounds)", "ratio (95% CI)",
         "every position"],
        table_rows(summary),
        intro=[
            f"# Offline tree accept lengths: {args.data.name}, {len(sequences)} responses",
            "",
            "    " + command_line(),
        ],
    )  # fmt: skip


if __name__ == "__main__":
    main()
