"""Logprobs of the emitted tokens through the tree runner (engine/acceptance.py
accepted_logprobs): a token of a verification step is drawn at the row of its path's
parent node, and its logprobs must be the target's raw ones at that prefix, as vLLM
reports them without speculation, for the drafted tokens, the bonus and the tokens of
steps without trees alike."""

from __future__ import annotations

import math

import pytest
import torch

from .conftest import PROMPTS, SAMPLED_PROMPT, tree_stats

TOP = 3  # logprobs=3: the three best tokens beside the sampled one


def generate_with_logprobs(llm, prompts, params):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outputs]


def test_greedy_logprobs_equal_the_target_alone(conditional, baseline):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=TOP)
    before = tree_stats(conditional)
    ours = generate_with_logprobs(conditional, PROMPTS, params)
    after = tree_stats(conditional)
    theirs = generate_with_logprobs(baseline, PROMPTS, params)
    # The steps verified trees, and some accepted a sibling: a token whose row is not
    # its linear predecessor's.
    assert after["trees"] > before["trees"]
    assert after["sibling_accepts"] > before["sibling_accepts"]
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(ours, theirs, strict=True):
        assert tokens == want_tokens
        assert len(logprobs) == len(tokens)
        for token, got, want in zip(tokens, logprobs, want_logprobs, strict=True):
            assert token in got and len(got) in (TOP, TOP + 1)  # the top 3 and the token
            assert set(got) == set(want)
            for t, entry in got.items():
                assert math.isclose(entry.logprob, want[t].logprob, abs_tol=1e-4), (t, entry)
                assert entry.rank == want[t].rank


@pytest.fixture(scope="module")
def raw_target(pair_dirs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(pair_dirs["target"], dtype=torch.float32).eval()


def test_sampled_tokens_carry_the_targets_raw_logprobs(conditional, raw_target):
    """Sampled (temperature 0.9, top-k 12) seeded requests: each token's reported logprob
    is the target's raw log-softmax after that run's own prefix (before temperature and
    top-k, vLLM's default logprobs_mode)."""
    from vllm import SamplingParams

    params = [
        SamplingParams(
            temperature=0.9, top_k=12, max_tokens=12, seed=s, ignore_eos=True, logprobs=1
        )
        for s in range(24)
    ]
    before = tree_stats(conditional)["accepted_tokens"]
    outputs = conditional.generate(
        [{"prompt_token_ids": SAMPLED_PROMPT}] * len(params), params, use_tqdm=False
    )
    assert tree_stats(conditional)["accepted_tokens"] > before  # drafted tokens among them
    with torch.no_grad():
        for output in outputs:
            tokens = list(output.outputs[0].token_ids)
            sequence = torch.tensor([SAMPLED_PROMPT + tokens])
            logits = raw_target(sequence).logits[0, len(SAMPLED_PROMPT) - 1 : -1]
            want = torch.log_softmax(logits.double(), dim=-1)
            for i, (token, got) in enumerate(zip(tokens, output.outputs[0].logprobs, strict=True)):
                assert math.isclose(got[token].logprob, want[i, token].item(), abs_tol=1e-4)
                best = int(want[i].argmax())
                assert best in got and got[best].rank == 1
