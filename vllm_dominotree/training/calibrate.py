"""Fit a drafter's score temperatures (drafter/score_temperature.py) on its target's answers.

    python -m vllm_dominotree.training.calibrate --target DIR --drafter DIR \\
        --data ANSWERS.jsonl[.xz] [--limit 40] [--stride 4] [--candidates 64] [--write]

ANSWERS: the target's own greedy answers to prompts the drafter was not trained on and
that are not evaluation prompts (training/distill.py with another seed than the
training data's). At every --stride-th response position the drafter drafts the block
anchored there, teacher-forced as in training and in training/evaluate.py, and each draft row is
scored as the trees score it:
- conditional: Domino's corrected logits over the marginal top-M candidates of the row
  (M = --candidates, the engine's `candidates`), rows whose target token is among them;
- marginal: the marginal logits over the whole vocabulary.
For each scorer T minimises the rows' mean negative log-likelihood of the target's token
under softmax(logits / T) (temperature scaling), over a grid of steps of about 5% from
0.5 to 4. Prints the fit as JSON; --write stores the temperatures in the drafter's
folder, where engines read them when the user names no `score_temperature`.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from ..drafter.model import Drafter
from ..drafter.score_temperature import TREE_SCORERS, write_temperatures
from .evaluate import ANCHORS_PER_PASS, first_anchor
from .trainer import Batch, block_logits, load_sequences, target_features

# Temperatures tried: 43 points evenly spaced in log T over [0.5, 4] (steps of 5%).
GRID = torch.exp(torch.linspace(math.log(0.5), math.log(4.0), 43)).tolist()


class NllAccumulator:
    """Sum over rows of -log softmax(logits / T)[label] for every T of GRID, and the
    rows counted."""

    def __init__(self) -> None:
        self.sums = torch.zeros(len(GRID), dtype=torch.float64)
        self.rows = 0

    def add(self, logits: torch.Tensor, label_logit: torch.Tensor) -> None:
        """logits [N, W] float32, label_logit [N] (the target token's logit, in the row).
        Each row's terms in float32 (a row's logits over the whole vocabulary at every T
        in float64 took seconds a block on 2 cores), their sum in float64."""
        for g, t in enumerate(GRID):
            terms = torch.logsumexp(logits / t, -1) - label_logit / t
            self.sums[g] += terms.sum(dtype=torch.float64)
        self.rows += logits.shape[0]

    def fit(self) -> dict:
        """The best T and the mean NLL there and at T = 1."""
        if not self.rows:
            raise ValueError("no rows to fit on: the answers hold no full block after a prompt")
        mean = self.sums / self.rows
        best = int(mean.argmin())
        at_one = int((torch.tensor(GRID) - 1.0).abs().argmin())
        return {
            "temperature": round(GRID[best], 4),
            "rows": self.rows,
            "nll": round(float(mean[best]), 5),
            "nll_at_1": round(float(mean[at_one]), 5),
        }


@torch.no_grad()
def accumulate(
    target,
    drafter: Drafter,
    sequences: list[tuple[list[int], int]],
    candidates: int,
    stride: int = 1,
) -> dict[str, NllAccumulator]:
    """Both scorers' NLL sums over every stride-th anchor of the sequences' responses."""
    device = next(target.parameters()).device
    k, layers = drafter.spec.num_drafts, drafter.spec.target_layer_ids
    sums = {scorer: NllAccumulator() for scorer in TREE_SCORERS}
    for tokens, prompt_len in sequences:
        ids, length = torch.tensor([tokens]), torch.tensor([len(tokens)])
        features = target_features(target, layers, ids.to(device), length.to(device))
        first = first_anchor(prompt_len)
        anchors = torch.arange(first, max(first, len(tokens) - k), stride)
        for chunk in anchors.split(ANCHORS_PER_PASS):
            batch = Batch(ids, length, chunk[None], torch.ones(1, len(chunk), dtype=torch.bool))
            logits = block_logits(target, drafter, batch, device, features)
            labels = logits.labels.flatten()[:, None]  # [N, 1]
            base = logits.base.flatten(0, 2).float()  # [N, V]
            sums["marginal"].add(base, base.gather(1, labels)[:, 0])
            # The conditional scorer's rows: the corrected logits of the marginal top M.
            index = base.topk(candidates, -1).indices  # [N, M]
            corrected = logits.corrected.flatten(0, 2).float().gather(1, index)
            inside = index == labels  # [N, M]
            found = inside.any(-1)
            label_logit = (corrected * inside).sum(-1)
            sums["conditional"].add(corrected[found], label_logit[found])
    return sums


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_dominotree.training.calibrate", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--drafter", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--limit", type=int, default=40, help="responses used (the first N)")
    parser.add_argument("--stride", type=int, default=4, help="every Nth anchor of a response")
    parser.add_argument("--candidates", type=int, default=64)
    parser.add_argument("--write", action="store_true", help="store the fit in the drafter")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    target = target.to(args.device).eval()
    drafter = Drafter.load(str(args.drafter), device=args.device)
    sequences = load_sequences(args.data)[: args.limit]
    sums = accumulate(target, drafter, sequences, args.candidates, args.stride)
    fits = {name: acc.fit() for name, acc in sums.items()}
    fit = {"data": args.data.name, "responses": len(sequences), "stride": args.stride}
    fit |= {"candidates": args.candidates}
    fit |= {"scorers": fits}
    print(json.dumps(fit, indent=1))
    if args.write:
        temperatures = {name: f["temperature"] for name, f in fits.items()}
        print(f"wrote {write_temperatures(args.drafter, temperatures, fit)}")


if __name__ == "__main__":
    main()
