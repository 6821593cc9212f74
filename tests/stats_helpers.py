"""Pearson's chi-square test on counts against an expected law (shared by the tests)."""

from __future__ import annotations

import torch
from scipy.stats import chisquare


def pooled_chi2_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """observed: counts per category; expected: expected counts (any scale). Cells
    expected to hold fewer than 5 counts are pooled into one; a category the law gives
    zero mass but that was observed fails outright (p = 0)."""
    observed, expected = observed.double(), expected.double()
    if (observed[expected == 0] > 0).any():
        return 0.0
    expected = expected * observed.sum() / expected.sum()
    keep = expected >= 5
    obs, exp = [observed[keep]], [expected[keep]]
    if expected[~keep].sum() > 0:
        obs.append(observed[~keep].sum()[None])
        exp.append(expected[~keep].sum()[None])
    return float(chisquare(torch.cat(obs).numpy(), torch.cat(exp).numpy()).pvalue)
