"""A drafter's draft vocabulary: the target's most frequent tokens, which its logits cover.

The drafter's marginal logits are a product with the target's lm_head over the whole
vocabulary for every depth of every request, each step: on SmolLM2-135M's 49,152 x 576
lm_head that is 57 MB read per step, about 4 ms of a 66 ms CPU step
(benchmarks/results/smollm2_drafter_v2.md). Almost all of a target's output falls in a
few thousand tokens, so the drafter may draft from those only (as EAGLE-3's drafters do):
the logits, the top-M and the correction then cover S rows instead of V. Output stays
lossless (the target verifies every drafted token); a token outside the draft vocabulary
is simply never drafted.

A drafter ships its ranking beside its weights, in `draft_vocab/ranking.safetensors`: one
int64 tensor `ranking`, token ids most frequent first (ties in id order), counted over the
target's own answers to training prompts (training/draft_vocab.py writes it). The
`draft_vocab` option takes its first S entries. The file sits in a folder of its own
because vLLM loads every `*.safetensors` file at the top of a checkpoint that has no
weight index as weights, and stops at a tensor it does not know ("no module or parameter
named 'ranking'": the released single-file drafters, and the benchmarks' random ones,
on 2026-12-05).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .checkpoint import DrafterFormatError

RANKING_FILE = Path("draft_vocab") / "ranking.safetensors"
RANKING_TENSOR = "ranking"


def ranking_path(drafter_dir: str | Path) -> Path:
    return Path(drafter_dir) / RANKING_FILE


def has_ranking(drafter_dir: str | Path) -> bool:
    return ranking_path(drafter_dir).is_file()


def read_ranking(drafter_dir: str | Path, vocab_size: int) -> torch.Tensor:
    """The drafter's token ranking [N] int64, checked: ids distinct and below vocab_size."""
    path = ranking_path(drafter_dir)
    if not path.is_file():
        raise DrafterFormatError(
            f"{path} is missing: a draft vocabulary needs the drafter's token ranking; write "
            "one with `python -m vllm_dominotree.training.draft_vocab --data DATA.jsonl "
            f"--drafter {drafter_dir} --target TARGET_DIR`, or set draft_vocab 0 (the whole "
            "vocabulary)"
        )
    with safe_open(path, framework="pt") as f:
        names = f.keys()  # safe_open has no __contains__
        if RANKING_TENSOR not in names:
            raise DrafterFormatError(f"{path} holds no tensor {RANKING_TENSOR!r}")
        ranking = f.get_tensor(RANKING_TENSOR)
    if ranking.dtype != torch.int64 or ranking.dim() != 1 or ranking.numel() == 0:
        raise DrafterFormatError(
            f"{path}: {RANKING_TENSOR!r} must be a non-empty 1-D int64 tensor, got "
            f"{ranking.dtype} of shape {tuple(ranking.shape)}"
        )
    if int(ranking.min()) < 0 or int(ranking.max()) >= vocab_size:
        raise DrafterFormatError(f"{path}: token ids must lie in [0, {vocab_size})")
    if torch.unique(ranking).numel() != ranking.numel():
        raise DrafterFormatError(f"{path}: a token id appears more than once")
    return ranking


def write_ranking(drafter_dir: str | Path, ranking: torch.Tensor) -> Path:
    path = ranking_path(drafter_dir)
    path.parent.mkdir(exist_ok=True)
    save_file({RANKING_TENSOR: ranking.to(torch.int64).contiguous()}, str(path))
    return path


def default_size(drafter_dir: str | Path, preferred: int, vocab_size: int) -> int:
    """A device's preferred draft vocabulary for this drafter: `preferred` tokens, or all
    it ranks if fewer; 0 (the whole vocabulary) where that leaves none out or the drafter
    ships no ranking."""
    if not has_ranking(drafter_dir):
        return 0
    size = min(preferred, read_ranking(drafter_dir, vocab_size).numel())
    return 0 if size >= vocab_size else size


def draft_vocab_ids(drafter_dir: str | Path, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent tokens of the drafter's ranking, in id order [size] int64
    (id order, so that ties among equal logits break as over the whole vocabulary)."""
    ranking = read_ranking(drafter_dir, vocab_size)
    if size > ranking.numel():
        raise DrafterFormatError(
            f"draft_vocab {size} is more than the {ranking.numel()} tokens ranked in "
            f"{ranking_path(drafter_dir)}; use draft_vocab <= {ranking.numel()}, or 0 for "
            "the whole vocabulary"
        )
    return ranking[:size].sort().values
