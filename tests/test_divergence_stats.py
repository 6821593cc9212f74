"""The bf16 divergence test's bars, on known counts and outputs (the GPU test applies
them)."""

from __future__ import annotations

import itertools

import pytest
from divergence_stats import (
    NEAR_TIE,
    SIGNIFICANCE,
    diverged,
    not_near_ties,
    top_two_margins,
    worse_p_value,
)
from vllm.logprobs import Logprob


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


def test_top_two_margins_reads_the_lead_and_the_runner_up_from_vllms_logprobs():
    # logprobs=2 gives the sampled token and the top two; greedy samples the top one.
    positions = [
        {7: Logprob(-0.1, 1), 3: Logprob(-2.6, 2)},
        {5: Logprob(-0.70, 1), 9: Logprob(-0.69, 2), 4: Logprob(-3.0, 3)},  # 5 sampled, 9 led
    ]
    (lead0, second0), (lead1, second1) = top_two_margins(positions)
    assert (second0, second1) == (3, 5)
    assert lead0 == pytest.approx(2.5) and lead1 == pytest.approx(0.01)


def test_divergences_are_placed_and_told_apart_from_flipped_near_ties():
    target = {
        "want": [[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8], [5, 6, 7, 8]],
        # per position: (the top token's lead, the runner-up)
        "margins": [
            [(3.0, 0), (3.0, 0), (0.02, 9), (3.0, 0)],
            [(3.0, 0), (2.0, 8), (3.0, 0), (3.0, 0)],
            [(3.0, 0)] * 4,
            [(0.5, 1), (3.0, 0), (3.0, 0), (3.0, 0)],
        ],
    }
    outputs = [
        [1, 2, 9, 0],  # prompt 0: the runner-up at a near tie, then anything
        [1, 8, 3, 4],  # prompt 1: the runner-up where the target led by 2 nats
        [5, 6, 7, 8],  # prompt 2: no divergence
        [2, 6, 7, 8],  # prompt 3: a near tie, but not the runner-up taken
    ]
    found = diverged(outputs, target, "probe")
    assert [(d["prompt"], d["at"]) for d in found] == [(3, 0), (1, 1), (0, 2)]
    assert [d["runner_up"] for d in found] == [False, True, True]
    assert [d["lead"] for d in found] == [0.5, 2.0, 0.02]
    assert [d["prompt"] for d in not_near_ties(found)] == [3, 1]
    assert not_near_ties([{"lead": NEAR_TIE / 2, "runner_up": True}]) == []
