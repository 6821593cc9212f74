"""The bf16 divergence test's bar, on known counts (the GPU test applies it)."""

from __future__ import annotations

import itertools

import pytest
from divergence_stats import SIGNIFICANCE, worse_p_value


@pytest.mark.parametrize(
    "plugin, dflash, worse",
    # 4 against 2 is a flip or two (the H200's marginal run, 2026-12-03); 64 against 3 is
    # the Triton fix-up's rounding (2026-12-02); 8 against 1 is already a pattern.
    [(4, 2, False), (3, 3, False), (0, 0, False), (2, 4, False), (64, 3, True), (8, 1, True)],
)
def test_worse_p_value_over_100_prompts(plugin, dflash, worse):
    assert (worse_p_value(plugin, dflash, 100) < SIGNIFICANCE) is worse


def test_worse_p_value_is_a_probability_that_falls_as_the_count_rises():
    values = [worse_p_value(k, 3, 100) for k in range(0, 20)]
    assert values[0] == 1.0 and all(0 < v <= 1 for v in values)
    assert all(a > b for a, b in itertools.pairwise(values))
