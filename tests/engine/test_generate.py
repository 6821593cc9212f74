"""LLM.generate with "method": "dominotree": lossless, really speculative, truthful metrics."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from .conftest import (
    PROMPTS,
    dominotree,
    greedy,
    make_llm,
    shutdown,
    spec_metrics,
    tree_stats,
)


@pytest.fixture(scope="module")
def expected(baseline):
    return greedy(baseline)


@pytest.fixture(scope="module", params=["marginal", "chain"])
def other_scorer(request, pair_dirs):
    llm = make_llm(pair_dirs, dominotree(pair_dirs, scorer=request.param))
    yield request.param, llm
    shutdown(llm)


def test_conditional_greedy_equals_the_target_alone(conditional, expected):
    before = tree_stats(conditional)
    assert greedy(conditional) == expected
    after = tree_stats(conditional)
    trees = after["trees"] - before["trees"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    assert trees > 0
    # Drafts that are often right: well above one token per verification.
    assert 1 + accepted / trees > 2.5
    # A tree that quietly degraded to a chain would never accept a non-first child.
    assert after["sibling_accepts"] > before["sibling_accepts"]
    assert after["kv_moves"] > before["kv_moves"]


def test_other_scorers_are_lossless(other_scorer, expected):
    scorer, llm = other_scorer
    assert greedy(llm) == expected
    stats = tree_stats(llm)
    assert stats["trees"] > 0 and stats["mean_accept_length"] > 1.5
    if scorer == "chain":
        assert stats["sibling_accepts"] == 0 and stats["kv_moves"] == 0


def test_vllm_metrics_agree_with_the_runner(pair_dirs):
    """vLLM's spec-decode counters (drafts, draft tokens, accepted, per position) must
    tell the same story as the runner's own accounting."""
    llm = make_llm(pair_dirs, dominotree(pair_dirs, budget=12))
    try:
        greedy(llm)
        metrics = spec_metrics(llm)
        stats = tree_stats(llm)
    finally:
        shutdown(llm)
    assert metrics["vllm:spec_decode_num_accepted_tokens"] == stats["accepted_tokens"]
    assert metrics["vllm:spec_decode_num_drafts"] >= stats["trees"]
    assert (
        metrics["vllm:spec_decode_num_draft_tokens"] == 12 * metrics["vllm:spec_decode_num_drafts"]
    )
    per_position = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert sum(per_position) == stats["accepted_tokens"]
    assert all(a >= b for a, b in itertools.pairwise(per_position))


def bigram_table(target_dir: str, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from vllm_dominotree.tree import SamplingParams, target_probs

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.arange(model.config.vocab_size)[:, None]).logits[:, -1]
    return target_probs(logits, SamplingParams(temperature, top_k, top_p)).double()


def test_sampled_tokens_follow_the_target_distribution(conditional, pair_dirs):
    """The toy target is a bigram model, so each sampled token's law given the previous
    token is known exactly; 600 seeded requests of 4 tokens each, through the trees."""
    from vllm import SamplingParams

    law = bigram_table(pair_dirs["target"], 0.9, 12, 0.95)
    params = [
        SamplingParams(temperature=0.9, top_k=12, top_p=0.95, max_tokens=4, seed=s)
        for s in range(600)
    ]
    before = tree_stats(conditional)["trees"]
    outputs = conditional.generate([{"prompt_token_ids": [5, 9]}] * 600, params, use_tqdm=False)
    assert tree_stats(conditional)["trees"] > before, "the sampled run did not use trees"
    runs = [[9, *o.outputs[0].token_ids] for o in outputs]
    for i in range(2, 5):
        observed = torch.bincount(torch.tensor([r[i] for r in runs]), minlength=law.shape[1])
        expected = law[torch.tensor([r[i - 1] for r in runs])].sum(0)
        assert (observed[expected == 0] == 0).all(), "a token the target never samples"
        keep = expected >= 5
        obs = torch.cat([observed[keep].double(), observed[~keep].sum()[None].double()])
        exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
        assert chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue > 1e-3


def test_seeds_reproduce(conditional):
    from vllm import SamplingParams

    def run(seed):
        params = SamplingParams(temperature=1.0, max_tokens=30, seed=seed)
        return list(conditional.generate([{"prompt_token_ids": PROMPTS[2]}], params,
                                         use_tqdm=False)[0].outputs[0].token_ids)  # fmt: skip

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_plain_dflash_chain_matches_vllm_dflash(pair_dirs, expected):
    """A plain DFlash checkpoint through the plugin's chain scorer drafts exactly what
    vLLM's own "dflash" method drafts: same outputs and the same acceptance, position by
    position."""
    results = {}
    configs = {
        "plugin": {"method": "dominotree", "model": pair_dirs["dflash"], "scorer": "chain"},
        "vllm": {"method": "dflash", "model": pair_dirs["dflash"], "num_speculative_tokens": 7},
    }
    for name, config in configs.items():
        llm = make_llm(pair_dirs, config)
        try:
            results[name] = (greedy(llm), spec_metrics(llm))
        finally:
            shutdown(llm)
    assert results["plugin"][0] == results["vllm"][0] == expected
    ours, theirs = results["plugin"][1], results["vllm"][1]
    for key in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens",
                "vllm:spec_decode_num_accepted_tokens_per_pos"):  # fmt: skip
        assert ours[key] == theirs[key], key
    assert ours["vllm:spec_decode_num_accepted_tokens"] > 0
