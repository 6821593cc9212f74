"""Rank the target's tokens by how often its own answers use them, for a draft vocabulary.

    python -m vllm_dominotree.training.draft_vocab --data DATA.jsonl --drafter DRAFTER_DIR \
        --vocab-size V [--always ID ...]

DATA.jsonl: the distilled answers the drafter trains on (training/distill.py: the target's
greedy answers to training prompts, none sharing an 8-gram with an evaluation set), so
no evaluation text decides the vocabulary. Only answer tokens count (the prompt is not
what the drafter drafts); `--always` ids (the target's end-of-turn tokens) rank first
whatever their count. Writes DRAFTER_DIR/draft_vocab.safetensors (drafter/draft_vocab.py)
and prints how much of the answers the first S tokens cover.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..drafter.draft_vocab import write_ranking
from .trainer import load_sequences


def token_counts(sequences: list[tuple[list[int], int]], vocab_size: int) -> torch.Tensor:
    """How often each token occurs in the answers (after each prompt), [V] int64."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for tokens, prompt_len in sequences:
        counts += torch.bincount(torch.tensor(tokens[prompt_len:]), minlength=vocab_size)
    return counts


def rank_tokens(counts: torch.Tensor, always: list[int] = ()) -> torch.Tensor:
    """The tokens that occur, most frequent first, equal counts in id order; `always`
    first of all. [V] counts -> [N] int64 ids."""
    keys = counts.clone()
    keys[list(always)] = int(counts.max()) + 1
    order = torch.sort(-keys, stable=True).indices
    return order[: int((keys > 0).sum())]


def coverage(counts: torch.Tensor, ranking: torch.Tensor, sizes: list[int]) -> dict[int, float]:
    """The share of all counted tokens that the first S of the ranking hold, per S."""
    total = int(counts.sum())
    ranked = counts[ranking].cumsum(0)
    return {s: int(ranked[min(s, ranked.numel()) - 1]) / total for s in sizes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--drafter", type=Path, required=True)
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--always", type=int, nargs="*", default=[])
    args = parser.parse_args()
    counts = token_counts(load_sequences(args.data), args.vocab_size)
    ranking = rank_tokens(counts, args.always)
    path = write_ranking(args.drafter, ranking)
    shares = coverage(counts, ranking, [1024, 2048, 4096, 8192, 16384])
    print(f"{path}: {ranking.numel()} tokens ranked from {int(counts.sum())} answer tokens")
    for size, share in shares.items():
        print(f"  first {size}: {share:.4%} of them")


if __name__ == "__main__":
    main()
