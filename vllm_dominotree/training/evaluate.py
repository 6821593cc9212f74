"""How well a drafter predicts its target, offline, in minutes on a CPU rather than engine runs.

    python -m vllm_dominotree.training.evaluate --target DIR --drafter DIR \\
        --data FILE.jsonl [--sets humaneval mtbench math500 aime24 --limit 10] [--json OUT]

--data holds the target's own greedy responses to prompts, as training reads them
({"tokens": [...], "prompt_len": n}); with --sets it is first written from those
evaluation sets' prompts (the first user turn of the first --limit conversations of
each) if it does not exist. These responses are for measuring only; training data comes
from distill.py, whose prompts share no 8-gram with any of these sets.

At every response position p with a full block after it, the drafter drafts the block
anchored at p from the target's features before p, exactly as training sees it
(trainer.block_logits). Per draft row: whether the marginal argmax and Domino's
corrected argmax (its GRU over the true tokens) equal the target's token; per anchor,
the run of right drafts from the first row, which is what a chain round anchored there
commits (as long as the drafts are right, the GRU has seen the true tokens). Reported:
first-draft accuracy and `chain accept length` = 1 + the mean run (bonus included) for
both. Every position counts once here, where an engine's rounds skip what they accepted,
so this is above the engine's mean accept length (the shipped SmolLM2 drafter on the
twelve harness prompts, in the one-off run this tool came from: 1.46 here against
1.34 for the reference decoder's chain rounds); it
is the learning curve's measure, not a speedup.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from ..drafter.model import Drafter
from ..evaluation.bootstrap import paired_bootstrap
from ..evaluation.datasets import load_dataset
from .trainer import Batch, block_logits, load_sequences, target_features

ANCHORS_PER_PASS = 64  # anchors of one sequence drafted together (bounds the [A, K, V] logits)


@dataclass
class DraftAccuracy:
    anchors: int
    first_draft_marginal: float  # P(row 0's marginal argmax is the target's token)
    first_draft_corrected: float
    chain_accept_marginal: float  # 1 + mean run of right marginal argmaxes
    chain_accept_corrected: float  # 1 + mean run of right corrected argmaxes (Domino's chain)


def first_anchor(prompt_len: int) -> int:
    """The first anchor evaluated: the prompt's last token (its block drafts the response)."""
    return max(prompt_len - 1, 1)


Runs = dict[str, torch.Tensor]  # one sequence's chain_runs: {"marginal": [A], "corrected": [A]}


@torch.no_grad()
def chain_runs(target, drafter: Drafter, tokens: list[int], prompt_len: int) -> Runs:
    """Per anchor p = first_anchor(prompt_len) .. len(tokens) - K - 1: how many of the
    block's drafts from the first are the target's tokens, for the marginal and the
    corrected argmax. -> {"marginal": [A], "corrected": [A]}"""
    device = next(target.parameters()).device
    k = drafter.spec.num_drafts
    runs: dict[str, list[torch.Tensor]] = {"marginal": [], "corrected": []}
    ids, length = torch.tensor([tokens]), torch.tensor([len(tokens)])
    # The target's features once per sequence, for every pass over its anchors.
    layers = drafter.spec.target_layer_ids
    features = target_features(target, layers, ids.to(device), length.to(device))
    first = first_anchor(prompt_len)
    positions = torch.arange(first, max(first, len(tokens) - k))  # none for short answers
    if not len(positions):
        return {name: torch.zeros(0, dtype=torch.long) for name in runs}
    for chunk in positions.split(ANCHORS_PER_PASS):
        batch = Batch(ids, length, chunk[None], torch.ones(1, len(chunk), dtype=torch.bool))
        logits = block_logits(target, drafter, batch, device, features)
        for name, rows in (("marginal", logits.base), ("corrected", logits.corrected)):
            right = (rows.argmax(-1) == logits.labels)[0]  # [A, K]
            runs[name].append(right.long().cumprod(-1).sum(-1).cpu())
    return {name: torch.cat(parts) for name, parts in runs.items()}


def summarize(per_sequence: list[Runs]) -> DraftAccuracy:
    """The accuracy figures over the anchors of all sequences."""
    marginal, corrected = (
        torch.cat([runs[name] for runs in per_sequence]).float()
        for name in ("marginal", "corrected")
    )
    if not len(marginal):
        raise ValueError("no response holds a full block after its first position")
    return DraftAccuracy(
        anchors=len(marginal),
        first_draft_marginal=(marginal >= 1).float().mean().item(),
        first_draft_corrected=(corrected >= 1).float().mean().item(),
        chain_accept_marginal=1 + marginal.mean().item(),
        chain_accept_corrected=1 + corrected.mean().item(),
    )


def sequence_runs(target, drafter: Drafter, sequences: list[tuple[list[int], int]]) -> list[Runs]:
    """chain_runs for each (tokens, prompt_len) of the target's responses."""
    return [chain_runs(target, drafter, t, n) for t, n in sequences]


def draft_accuracy(target, drafter: Drafter, sequences: list[tuple[list[int], int]]):
    """Teacher-forced accuracy of `drafter` on the target's responses (module docstring)."""
    return summarize(sequence_runs(target, drafter, sequences))


def over(per_sequence: list[Runs], base: list[Runs]) -> dict:
    """One drafter's figures over another's on the same responses: ratios with paired
    bootstrap 95% intervals, resampling responses (an answer's anchors move together)."""
    first = lambda runs: summarize(runs).first_draft_corrected
    chain = lambda runs: summarize(runs).chain_accept_corrected
    return {
        "first_draft_ratio": first(per_sequence) / first(base),
        "first_draft_ratio_ci": paired_bootstrap(per_sequence, base, first, samples=1000),
        "chain_accept_ratio": chain(per_sequence) / chain(base),
        "chain_accept_ratio_ci": paired_bootstrap(per_sequence, base, chain, samples=1000),
    }


def evaluation_prompts(sets: list[str], limit: int) -> list[str]:
    """The first user turn of the first `limit` conversations of each set."""
    return [conversation[0] for name in sets for conversation in load_dataset(name)[:limit]]


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_dominotree.training.evaluate", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--drafter", type=Path, nargs="+", required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--sets", nargs="+", help="write --data from these sets if it is missing")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="float32", help="of the responses' vLLM engine")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if not args.data.exists():
        if not args.sets:
            parser.error(f"{args.data} does not exist; --sets writes it")
        from vllm import LLM

        from .distill import answer

        llm = LLM(model=str(args.target), dtype=args.dtype, seed=0)
        answer(llm, evaluation_prompts(args.sets, args.limit), args.data, args.max_tokens)
        llm.llm_engine.engine_core.shutdown()
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    target = target.to(args.device).eval()
    sequences = load_sequences(args.data)
    rows, first = [], None
    for drafter_dir in args.drafter:
        drafter = Drafter.load(str(drafter_dir), device=args.device)
        per_sequence = sequence_runs(target, drafter, sequences)
        rows.append({"drafter": str(drafter_dir), **asdict(summarize(per_sequence))})
        if first is None:
            first = per_sequence
        else:  # the corrected figures over the first drafter's
            rows[-1]["over_first"] = over(per_sequence, first)
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"data": str(args.data), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
