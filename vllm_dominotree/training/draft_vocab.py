"""Rank the target's tokens by how often its own answers use them, for a draft vocabulary.

    python -m vllm_dominotree.training.draft_vocab --data DATA.jsonl [MORE.jsonl ...] \
        --drafter DRAFTER_DIR --target TARGET_DIR

DATA.jsonl: the distilled answers the drafter trains on (training/distill.py: the target's
greedy answers to training prompts, none sharing an 8-gram with an evaluation set), so
no evaluation text decides the vocabulary. Only answer tokens count (the prompt is not
what the drafter drafts); the target's end-of-sequence ids (its config's and generation
config's `eos_token_id`) rank first whatever their count. Writes
DRAFTER_DIR/draft_vocab/ranking.safetensors (drafter/draft_vocab.py) and prints how much of the
answers the first S tokens cover: of the answers ranked, and of held-out answers (every
other answer ranked, the rest counted).
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
    """Every token: `always` first, then those that occur, most frequent first, then those
    that never do; equal counts in id order. [V] counts -> [V] int64 ids. Ids order the
    unseen because a byte-pair vocabulary numbers its tokens in merge order, i.e. by
    frequency in the tokenizer's corpus: SmolLM2's first 8192 ids held 89.8% of held-out
    distilled answers' tokens, where 8192 random ids hold 17% in expectation
    (benchmarks/results/draft_vocab_cpu.md)."""
    keys = counts.clone()
    keys[list(always)] = int(counts.max()) + 1
    return torch.sort(-keys, stable=True).indices


def coverage(counts: torch.Tensor, ranking: torch.Tensor, sizes: list[int]) -> dict[int, float]:
    """The share of all counted tokens that the first S of the ranking hold, per S (nan
    when nothing was counted)."""
    total = int(counts.sum()) or float("nan")
    ranked = counts[ranking].cumsum(0)
    return {s: int(ranked[min(s, ranked.numel()) - 1]) / total for s in sizes}


def vocabulary_of(target_dir: Path) -> tuple[int, list[int]]:
    """(vocabulary size, end-of-sequence ids) of a Hugging Face target folder."""
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(target_dir).get_text_config()
    eos: set[int] = set()
    sources = [config.eos_token_id]
    if (target_dir / "generation_config.json").is_file():
        sources.append(GenerationConfig.from_pretrained(target_dir).eos_token_id)
    for ids in sources:
        eos |= {ids} if isinstance(ids, int) else set(ids or ())
    return config.vocab_size, sorted(eos)


def held_out_coverage(
    sequences: list[tuple[list[int], int]], vocab_size: int, always: list[int], sizes: list[int]
) -> dict[int, float]:
    """coverage() of the odd answers by the ranking of the even ones."""
    ranking = rank_tokens(token_counts(sequences[::2], vocab_size), always)
    return coverage(token_counts(sequences[1::2], vocab_size), ranking, sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, nargs="+", required=True)
    parser.add_argument("--drafter", type=Path, required=True)
    parser.add_argument("--target", type=Path, required=True, help="the target's folder")
    args = parser.parse_args()
    vocab_size, eos_ids = vocabulary_of(args.target)
    sequences = [s for path in args.data for s in load_sequences(path)]
    counts = token_counts(sequences, vocab_size)
    ranking = rank_tokens(counts, eos_ids)
    path = write_ranking(args.drafter, ranking)
    sizes = [1024, 2048, 4096, 8192, 16384, 24576]
    shares = coverage(counts, ranking, sizes)
    held_out = held_out_coverage(sequences, vocab_size, eos_ids, sizes)
    seen = int((counts > 0).sum())
    print(f"{path}: {seen} distinct tokens in {int(counts.sum())} answer tokens, ranked first")
    for size in sizes:
        print(f"  first {size}: {shares[size]:.4%} of them, {held_out[size]:.4%} held out")


if __name__ == "__main__":
    main()
