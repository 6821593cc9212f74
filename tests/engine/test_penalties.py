"""Presence, frequency and repetition penalties through the tree runner
(engine/acceptance.py penalized): a tree row's output so far is its request's output and
the drafted tokens on the row's own path, so greedy output with penalties is the
target's own with the same penalties, token for token."""

from __future__ import annotations

import pytest

from .conftest import PROMPTS, tree_stats

PENALTIES = [
    {"repetition_penalty": 3.0},
    {"presence_penalty": 2.0, "frequency_penalty": 1.0},
]


def greedy_with(llm, penalties: dict, max_tokens: int = 40) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **penalties)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("penalties", PENALTIES, ids=["repetition", "presence-frequency"])
def test_greedy_with_penalties_equals_the_target_alone(conditional, baseline, penalties):
    want = greedy_with(baseline, penalties)
    # The penalties move the target's own output: a runner that ignored them would fail.
    assert want != greedy_with(baseline, {})
    before = tree_stats(conditional)
    got = greedy_with(conditional, penalties)
    after = tree_stats(conditional)
    assert got == want
    # Trees verified the tokens, accepting drafted ones and siblings among them.
    assert after["accepted_tokens"] > before["accepted_tokens"]
    assert after["sibling_accepts"] > before["sibling_accepts"]


def test_a_batch_mixing_penalties_and_none_equals_the_target_alone(conditional, baseline):
    """Requests with and without penalties in one batch: each gets its own."""
    from vllm import SamplingParams

    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **PENALTIES[i % 2])
        if i % 3
        else SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]

    def run(llm):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    assert run(conditional) == run(baseline)
