"""What shapes a request's law beyond temperature, top-k and top-p, through the tree
runner (engine/sampling_constraints.py): a tree row stands for its request's output and
the drafted tokens on its own path, so greedy output under penalties, logit_bias,
allowed_token_ids and min_tokens is the target's own under the same, token for token,
and min_p samples follow the target's min_p law. (vLLM refuses min_p and logit_bias with
its own speculative methods; the plugin lifts that for its V1 tree runner.)"""

from __future__ import annotations

import pytest
import torch
from stats_helpers import pooled_chi2_pvalue

from .conftest import PROMPTS, SAMPLED_PROMPT, tree_stats

GREEDY_CONSTRAINTS = {
    # Strong penalties: a row that ignored its path's drafts would pick them again.
    "repetition": {"repetition_penalty": 3.0},
    "presence-frequency": {"presence_penalty": 2.0, "frequency_penalty": 1.0},
    "logit-bias": {"logit_bias": {7: 3.0, 12: 2.5, 40: -100.0}},
    "allowed-tokens": {"allowed_token_ids": list(range(0, 64, 3))},
}


def greedy_with(llm, constraints: dict, prompts=PROMPTS, max_tokens: int = 40, **extra):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, **constraints, **extra)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("name", list(GREEDY_CONSTRAINTS))
def test_greedy_under_constraints_equals_the_target_alone(conditional, baseline, name):
    constraints = GREEDY_CONSTRAINTS[name]
    want = greedy_with(baseline, constraints, ignore_eos=True)
    # The constraint moves the target's own output: a runner that ignored it would fail.
    assert want != greedy_with(baseline, {}, ignore_eos=True)
    before = tree_stats(conditional)
    got = greedy_with(conditional, constraints, ignore_eos=True)
    after = tree_stats(conditional)
    assert got == want
    # Trees verified the tokens, accepting drafted ones and siblings among them.
    assert after["accepted_tokens"] > before["accepted_tokens"]
    assert after["sibling_accepts"] > before["sibling_accepts"]


def test_min_tokens_holds_the_stop_tokens_back_along_each_path(conditional, baseline):
    """Each prompt stops at its own first greedy token unless min_tokens holds it back: a
    tree row bars it while the request's output plus the drafts on the row's path are
    shorter than min_tokens, so the output is the target's own to the token."""
    firsts = [tokens[0] for tokens in greedy_with(baseline, {}, max_tokens=1, ignore_eos=True)]
    for prompt, stop in zip(PROMPTS, firsts, strict=True):
        plain = greedy_with(baseline, {}, [prompt], stop_token_ids=[stop])[0]
        assert len(plain) == 1  # it stops at once without min_tokens
        want = greedy_with(baseline, {"min_tokens": 12}, [prompt], stop_token_ids=[stop])[0]
        assert len(want) >= 12 and stop not in want[:11]
        got = greedy_with(conditional, {"min_tokens": 12}, [prompt], stop_token_ids=[stop])[0]
        assert got == want


def test_a_batch_mixing_constraints_and_none_equals_the_target_alone(conditional, baseline):
    """Requests with different constraints and none in one batch: each gets its own."""
    from vllm import SamplingParams

    kinds = [{}, *GREEDY_CONSTRAINTS.values()]
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **kinds[i % len(kinds)])
        for i in range(len(PROMPTS))
    ]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]

    def run(llm):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    assert run(conditional) == run(baseline)


def min_p_law(model, prefixes, temperature: float, min_p: float) -> dict:
    """The target's law after each prefix: temperature, then tokens below min_p x the
    likeliest one's probability dropped (vLLM's min_p), renormalized."""
    law = {}
    with torch.no_grad():
        for prefix in prefixes:
            logits = model(torch.tensor([prefix])).logits[0, -1].double()
            probs = (logits / temperature).softmax(-1)
            probs[probs < probs.max() * min_p] = 0
            law[prefix] = probs / probs.sum()
    return law


def test_min_p_samples_follow_the_targets_min_p_law(conditional, pair_dirs):
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    temperature, min_p, requests = 1.5, 0.2, 600  # min_p drops 22% of the first law
    params = [
        SamplingParams(temperature=temperature, min_p=min_p, max_tokens=3, seed=s, ignore_eos=True)
        for s in range(requests)
    ]
    before = tree_stats(conditional)["accepted_tokens"]
    outputs = conditional.generate(
        [{"prompt_token_ids": SAMPLED_PROMPT}] * requests, params, use_tqdm=False
    )
    assert tree_stats(conditional)["accepted_tokens"] > before  # drafted tokens among them
    runs = [tuple(SAMPLED_PROMPT + list(o.outputs[0].token_ids)) for o in outputs]
    start = len(SAMPLED_PROMPT)
    prefixes = sorted({r[: start + i] for r in runs for i in range(3)})
    model = AutoModelForCausalLM.from_pretrained(pair_dirs["target"], dtype=torch.float32).eval()
    law = min_p_law(model, prefixes, temperature, min_p)
    without = min_p_law(model, prefixes, temperature, 0.0)
    for i in range(start, start + 3):
        observed = torch.bincount(torch.tensor([r[i] for r in runs]), minlength=64).double()
        assert pooled_chi2_pvalue(observed, sum(law[r[:i]] for r in runs)) > 1e-3
        if i == start:  # min_p matters here: the first tokens do not follow the law without it
            assert pooled_chi2_pvalue(observed, sum(without[r[:i]] for r in runs)) < 1e-6
