"""Paired bootstrap intervals over prompts, shared by the benchmark harness (speedups,
accept lengths) and the drafter evaluator (one drafter over another)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import TypeVar

Record = TypeVar("Record")


def paired_bootstrap(
    method: Sequence[Record],
    base: Sequence[Record],
    stat: Callable[[list[Record]], float],
    samples: int = 2000,
    seed: int = 0,
) -> tuple[float, float]:
    """95% interval of stat(method) / stat(base), resampling prompts (the same picks
    for both: prompt i of one method pairs with prompt i of the other)."""
    if len(method) != len(base):
        raise ValueError(f"paired records differ in number: {len(method)} and {len(base)}")
    rng = random.Random(seed)
    n = len(method)
    ratios = []
    for _ in range(samples):
        picks = [rng.randrange(n) for _ in range(n)]
        ratios.append(stat([method[i] for i in picks]) / stat([base[i] for i in picks]))
    ratios.sort()
    return ratios[int(0.025 * samples)], ratios[int(0.975 * samples) - 1]
