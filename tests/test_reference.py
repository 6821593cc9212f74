"""The reference decoder: lossless in every mode, and acceptance that really happens."""

from __future__ import annotations

import pytest
import torch
from stats_helpers import pooled_chi2_pvalue

from vllm_dominotree.config import DominoTreeConfig
from vllm_dominotree.reference import ReferenceDecoder
from vllm_dominotree.tree import SamplingParams, target_probs

PROMPTS = [[5, 9, 12, 3, 7, 22], [40], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [30, 31]]
MODES = [
    dict(scorer="chain"),
    dict(scorer="marginal"),
    dict(scorer="conditional"),
    dict(scorer="conditional", candidates=16),
    dict(scorer="conditional", spine=True),
    dict(scorer="conditional", budget=5, max_children=2),
]


@pytest.mark.parametrize("options", MODES, ids=lambda o: "-".join(f"{v}" for v in o.values()))
@pytest.mark.parametrize("which", ["exact", "noisy", "attentive"])
def test_greedy_output_equals_the_target_alone(toy_pair, attentive_target, options, which):
    """ "attentive": a target whose tokens depend on the context, so that the tree's
    mask, positions and KV compaction are checked too (the bigram target cannot tell)."""
    target, exact, noisy, _ = toy_pair
    drafter = exact if which == "exact" else noisy
    if which == "attentive":
        target = attentive_target
    ar = ReferenceDecoder(target)
    spec = ReferenceDecoder(target, drafter, DominoTreeConfig(**options))
    for prompt in PROMPTS:
        expected = ar.generate(prompt, 40)
        got = spec.generate(prompt, 40)
        assert got.tokens == expected.tokens
        assert sum(got.accept_lengths) >= 39  # every committed token counted, none lost


def test_acceptance_is_deep_partial_and_takes_sibling_paths(toy_pair):
    target, exact, noisy, _ = toy_pair
    k = exact.spec.num_drafts
    chain = ReferenceDecoder(target, exact, DominoTreeConfig(scorer="chain"))
    whole = chain.generate(PROMPTS[0], 60)
    assert max(whole.accept_lengths) == k + 1, "whole-block acceptance"
    assert whole.mean_accept_length > 0.8 * (k + 1)

    tree = ReferenceDecoder(target, noisy, DominoTreeConfig(scorer="conditional"))
    lengths, siblings = [], 0
    for prompt in PROMPTS:
        result = tree.generate(prompt, 60)
        lengths += result.accept_lengths
        siblings += result.sibling_accepts
    assert sum(lengths) / len(lengths) > 2.5
    assert siblings > 0, "no accepted node was a non-first child: the tree acts as a chain"
    assert min(lengths) < max(lengths) and max(lengths) >= 5, "partial and deep paths"


def test_stage_timings_are_recorded(toy_pair):
    target, _, noisy, _ = toy_pair
    result = ReferenceDecoder(target, noisy, DominoTreeConfig()).generate(PROMPTS[0], 20)
    assert result.rounds > 0
    assert all(result.stage_seconds[s] > 0 for s in ("draft", "build", "verify", "commit"))
    assert result.decode_seconds >= sum(result.stage_seconds.values()) * 0.99


def test_stop_tokens_end_generation(toy_pair):
    target, _, noisy, _ = toy_pair
    ar = ReferenceDecoder(target).generate(PROMPTS[0], 30)
    stop = ar.tokens[10]
    first = ar.tokens.index(stop)
    for decoder in (ReferenceDecoder(target), ReferenceDecoder(target, noisy, DominoTreeConfig())):
        assert (
            decoder.generate(PROMPTS[0], 30, stop_token_ids=(stop,)).tokens
            == ar.tokens[: first + 1]
        )


def bigram_table(target, params: SamplingParams) -> torch.Tensor:
    """The toy target is a bigram model: row t is its next-token law after token t."""
    vocab = target.config.vocab_size
    with torch.no_grad():
        logits = target(torch.arange(vocab)[:, None]).logits[:, -1]
    return target_probs(logits, params).double()


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=8, top_p=0.9)]
)
def test_sampled_tokens_follow_the_target_distribution(toy_pair, params):
    """Many seeds, three tokens each: token 1 comes from the prefill, tokens 2 and 3 from
    the tree round. Given the token before it, each must follow the target's law."""
    target, _, noisy, _ = toy_pair
    law = bigram_table(target, params)
    decoder = ReferenceDecoder(target, noisy, DominoTreeConfig())
    prompt = [5, 9, 12]
    runs = [
        decoder.generate(prompt, 3, SamplingParams(**{**vars(params), "seed": seed})).tokens
        for seed in range(700)
    ]
    for i in (1, 2):
        observed = torch.bincount(torch.tensor([r[i] for r in runs]), minlength=law.shape[1])
        expected = law[torch.tensor([r[i - 1] for r in runs])].sum(0)
        assert pooled_chi2_pvalue(observed, expected) > 1e-3


def test_seeds_reproduce(toy_pair):
    target, _, noisy, _ = toy_pair
    decoder = ReferenceDecoder(target, noisy, DominoTreeConfig())
    params = SamplingParams(temperature=1.0, seed=7)
    a = decoder.generate(PROMPTS[0], 30, params).tokens
    assert decoder.generate(PROMPTS[0], 30, params).tokens == a
    assert decoder.generate(PROMPTS[0], 30, SamplingParams(temperature=1.0, seed=8)).tokens != a


def test_conditional_needs_a_domino_checkpoint(toy_pair, tmp_path):
    from vllm_dominotree.config import DominoTreeConfigError
    from vllm_dominotree.demo.toy_pair import write_drafter
    from vllm_dominotree.drafter import Drafter

    target, _, _, spec = toy_pair
    plain = Drafter.load(write_drafter(tmp_path / "dflash", spec, domino=False, shift_label=False))
    with pytest.raises(DominoTreeConfigError, match="needs a Domino checkpoint"):
        ReferenceDecoder(target, plain, DominoTreeConfig(scorer="conditional"))
    # Plain DFlash works with the marginal and chain scorers, losslessly.
    ar = ReferenceDecoder(target).generate(PROMPTS[0], 30).tokens
    for scorer in ("marginal", "chain"):
        got = ReferenceDecoder(target, plain, DominoTreeConfig(scorer=scorer)).generate(
            PROMPTS[0], 30
        )
        assert got.tokens == ar
