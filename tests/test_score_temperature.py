"""The trees' score temperature: the drafter's file, the option, the scorers' folding of
1/T into their tables, the fit (training/calibrate.py) and the offline accept lengths
(benchmarks/tree_accept_bench.py) that measure what it does."""

from __future__ import annotations

import importlib
import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
import tree_helpers
from tree_helpers import random_domino_checkpoint

from vllm_dominotree.config import DominoTreeConfig, DominoTreeConfigError
from vllm_dominotree.drafter import Drafter, DrafterFormatError
from vllm_dominotree.drafter.score_temperature import (
    default_temperature,
    read_temperatures,
    temperature_path,
    write_temperatures,
)
from vllm_dominotree.reference import ReferenceDecoder
from vllm_dominotree.speculative import translate
from vllm_dominotree.training.calibrate import GRID, NllAccumulator
from vllm_dominotree.tree import DeviceTreeBuilder, TreeShape, build_trees, make_scorer

V, K = 40, 5
ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    return random_domino_checkpoint(tmp_path_factory.mktemp("drafter"), V, K)


@pytest.fixture(scope="module")
def tree_accept_bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module("tree_accept_bench")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_the_drafters_file_gives_the_default_per_scorer(drafter_dir, tmp_path):
    assert (
        read_temperatures(drafter_dir) == {} and default_temperature(drafter_dir, "marginal") == 1
    )
    fitted = shutil.copytree(drafter_dir, tmp_path / "fitted")
    write_temperatures(fitted, {"conditional": 1.4, "marginal": 1.1}, {"data": "x"})
    assert default_temperature(fitted, "conditional") == 1.4
    assert default_temperature(fitted, "chain") == 1.0  # the chain's path does not move
    user = {"method": "dominotree", "model": str(fitted)}
    assert translate(user, on_cpu=True)[1]["score_temperature"] == 1.4
    assert translate({**user, "scorer": "marginal"}, on_cpu=False)[1]["score_temperature"] == 1.1
    assert translate({**user, "scorer": "chain"}, on_cpu=False)[1]["score_temperature"] == 1.0
    assert translate({**user, "score_temperature": 2}, on_cpu=True)[1]["score_temperature"] == 2
    # A file that is not the format names itself and the way to mend it.
    for bad in ({"temperatures": {"conditional": 0}}, {"temperatures": {"tree": 1.2}}, {}):
        temperature_path(fitted).write_text(json.dumps(bad))
        with pytest.raises(
            DominoTreeConfigError, match=r"'model'.*score_temperature\.json.*calibrate"
        ):
            translate(user, on_cpu=True)
        with pytest.raises(DrafterFormatError):
            read_temperatures(fitted)
    # A folder that holds no drafter is the 'model' key's problem, as before.
    with pytest.raises(DominoTreeConfigError, match="speculative config 'model'"):
        translate({**user, "model": str(tmp_path / "missing")}, on_cpu=True)


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, True, "1.4"])
def test_a_bad_option_is_refused_with_what_it_is(bad):
    with pytest.raises(DominoTreeConfigError, match="score_temperature must be a"):
        DominoTreeConfig(score_temperature=bad)


@pytest.mark.parametrize("temperature", [0.5, 1.4, 3.0])
@pytest.mark.parametrize("candidates", [8, V])  # a top-M restriction, the whole vocabulary
def test_conditional_children_are_the_log_softmax_of_logits_over_t(
    drafter_dir, temperature, candidates
):
    """With 1/T folded into the tables, a node's children are log_softmax(logits / T) of
    the scorer at T = 1's logits: the same tokens in the same order, rescaled."""
    head = Drafter.load(drafter_dir).head
    hidden, base, embed, _ = tree_helpers.random_step(head.hidden_size, V, K, 3, seed=1)
    shape = TreeShape(budget=V, max_depth=K, max_children=V)

    def children(t):
        scorer = make_scorer("conditional", head, embed, shape=shape, candidates=candidates,
                             prefix_len=1, max_requests=3, temperature=t)  # fmt: skip
        scorer.prepare(hidden, base)
        rows = torch.tensor(
            [[0, 1, 2], [1, 1, 1], [6, 6, 6], [4, 7, 9], [0, 2, 3]]
        )  # req, node, ...
        return scorer.children(*rows)

    plain_values, plain_tokens = children(1.0)
    values, tokens = children(temperature)
    # log-probs of logits / T from those of the logits (the logits up to a row constant).
    expected = torch.log_softmax(plain_values / temperature, dim=-1)
    assert torch.equal(tokens, plain_tokens)
    assert torch.allclose(values, expected, atol=1e-5)
    assert not torch.allclose(values, plain_values, atol=1e-2)


def test_marginal_log_probs_are_those_of_logits_over_t(drafter_dir):
    hidden, base, embed, _ = tree_helpers.random_step(16, V, K, 2, seed=2)
    shape = TreeShape(budget=6, max_depth=K, max_children=6)
    scorer = make_scorer("marginal", None, embed, shape=shape, candidates=V, prefix_len=1,
                         max_requests=2, temperature=2.0)  # fmt: skip
    scorer.prepare(hidden, base)
    expected, tokens = torch.log_softmax(base / 2.0, dim=-1).topk(6, dim=-1)
    assert torch.equal(scorer.tokens[:2], tokens)
    assert torch.allclose(scorer.logprobs[:2].float(), expected, atol=1e-5)


@pytest.mark.parametrize("kind", ["conditional", "marginal"])
def test_the_temperature_reshapes_trees_and_both_builders_agree(drafter_dir, kind):
    """A flatter score spends the budget on breadth: over random steps the trees change,
    with more leaves at T = 3 than at T = 1/3; the device builder still builds the host
    heap's trees bit for bit."""
    head = Drafter.load(drafter_dir).head
    shape = TreeShape(budget=12, max_depth=K, max_children=4)
    leaves = {}
    for t in (1 / 3, 3.0):
        leaves[t] = 0
        for seed in range(4):
            hidden, base, embed, anchors = tree_helpers.random_step(head.hidden_size, V, K, 4, seed)
            scorer = make_scorer(kind, head, embed, shape=shape, candidates=16, prefix_len=1,
                                 max_requests=4, temperature=t)  # fmt: skip
            scorer.prepare(hidden, base)
            host = build_trees(scorer, anchors, shape)
            builder = DeviceTreeBuilder(
                scorer, shape, chain=False, device=torch.device("cpu"), max_requests=4
            )
            device = builder.build(torch.tensor(anchors))
            assert [(t.tokens, t.parents, t.scores) for t in device] == [
                (t.tokens, t.parents, t.scores) for t in host
            ]
            leaves[t] += sum(not c for tree in host for c in tree.children)
    assert leaves[3.0] > leaves[1 / 3]


def test_the_fit_finds_the_temperature_the_labels_were_drawn_at():
    """Labels drawn from softmax(logits / 2): the likelihood is highest at T = 2, within
    the grid's step."""
    gen = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(20000, 30, generator=gen)
    labels = torch.multinomial(torch.softmax(logits / 2.0, -1), 1, generator=gen)[:, 0]
    accumulator = NllAccumulator()
    for rows, picks in zip(logits.split(5000), labels.split(5000), strict=True):
        accumulator.add(rows, rows.gather(1, picks[:, None])[:, 0])
    fit = accumulator.fit()
    assert fit["rows"] == 20000 and fit["nll"] < fit["nll_at_1"]
    assert abs(math.log(fit["temperature"] / 2.0)) <= math.log(GRID[1] / GRID[0])


def test_calibrate_writes_what_engines_then_read(toy_pair_dirs, tmp_path):
    """The tool end to end on the noisy toy pair's answers: it fits both scorers and
    --write stores the temperatures the option's default then takes."""
    import subprocess

    target_dir, drafter_dir, answers = toy_pair_dirs
    drafter = shutil.copytree(drafter_dir, tmp_path / "drafter")
    command = [sys.executable, "-m", "vllm_dominotree.training.calibrate",
               "--target", str(target_dir), "--drafter", str(drafter), "--data", str(answers),
               "--stride", "1", "--write"]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    fitted = read_temperatures(drafter)
    assert set(fitted) == {"conditional", "marginal"}
    fit = json.loads(temperature_path(drafter).read_text())["fit"]
    assert fit["scorers"]["conditional"]["rows"] > 0 and fit["responses"] == 3
    assert default_temperature(drafter, "conditional") == fitted["conditional"]


@pytest.fixture(scope="module")
def toy_pair_dirs(tmp_path_factory, toy_pair):
    """The noisy toy pair on disk and the target's greedy answers to three prompts."""
    from conftest import SIBLING_NOISE

    from vllm_dominotree.demo.toy_pair import PairSpec, write_pair

    root = tmp_path_factory.mktemp("calibrate")
    target_dir, drafter_dir = write_pair(root / "pair", PairSpec(noise=SIBLING_NOISE))
    target = toy_pair[0]
    lines = []
    for prompt in ([5, 9, 2, 30], [7, 1, 4], [11, 3, 8, 8, 2]):
        answer = ReferenceDecoder(target).generate(prompt, 40).tokens
        lines.append(json.dumps({"tokens": prompt + answer, "prompt_len": len(prompt)}))
    (root / "answers.jsonl").write_text("\n".join(lines) + "\n")
    return target_dir, drafter_dir, root / "answers.jsonl"


@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_offline_rounds_are_the_reference_decoders_rounds(toy_pair, tree_accept_bench, temperature):
    """The bench's replay of greedy rounds from per-anchor trees gives the accept lengths
    of the reference decoder's own conditional tree rounds on the target's answer."""
    target, _, noisy, _ = toy_pair
    prompt = [5, 9, 2, 30]
    config = DominoTreeConfig(budget=6, score_temperature=temperature)
    result = ReferenceDecoder(target, noisy, config).generate(prompt, 80)
    tokens = prompt + result.tokens
    builders = tree_accept_bench.tree_builders(target, noisy, {"c": config})
    accepts = tree_accept_bench.response_accepts(target, noisy, builders, tokens, len(prompt))
    per_anchor = accepts["c"]
    # The rounds whose block lies wholly inside the answer (the bench's anchors: the
    # first at the prompt's last token; the first round's at the prefill's token).
    rounds, p = [], len(prompt)
    for accepted in result.accept_lengths:
        if p - (len(prompt) - 1) >= len(per_anchor):
            break
        rounds.append(accepted)
        p += accepted
    replayed, i = [], 1
    while i < len(per_anchor):
        replayed.append(per_anchor[i] + 1)
        i += per_anchor[i] + 1
    assert len(rounds) >= 5 and replayed[: len(rounds)] == rounds
    assert 1 < sum(rounds) / len(rounds) < 1 + K  # rounds of several kinds
    assert tree_accept_bench.greedy_rounds(per_anchor) == (sum(replayed), len(replayed))


def test_each_config_is_compared_with_its_twin_at_t1(tree_accept_bench):
    names = ["conditional-16-t1", "conditional-16", "conditional-4-t1", "conditional-4-t2.5"]
    assert [tree_accept_bench.reference_of(n, names) for n in names] == [
        "conditional-16-t1",
        "conditional-16-t1",
        "conditional-4-t1",
        "conditional-4-t1",
    ]
    # Two responses: anchor 0 is the prompt's; rounds start at anchor 1.
    per_response = [
        {n: [9, 1, 0, 2, 0, 0, 0] for n in names} | {"conditional-16": [9, 4, 0, 0, 0, 0, 0]},
        {n: [9, 0, 0, 0] for n in names},
    ]
    summary = tree_accept_bench.summarize(per_response, names)
    # At T = 1 rounds of 2, 3, 1 tokens, then 1, 1, 1: 9 tokens in 6 rounds; the other:
    # 5, 1, then 1, 1, 1: 9 in 5.
    assert summary["conditional-16-t1"]["accept_length"] == 1.5
    assert summary["conditional-16"]["accept_length"] == 1.8
    assert summary["conditional-16"]["over"] == "conditional-16-t1"
    assert summary["conditional-16"]["ratio"] == 1.2
    assert "ratio" not in summary["conditional-16-t1"]


def test_an_answer_shorter_than_a_block_has_no_anchor(toy_pair, tree_accept_bench):
    """The evaluation sets hold such answers (one of 100 on 2026-12-07): they count for
    nothing rather than stop the bench."""
    target, _, noisy, _ = toy_pair
    builders = tree_accept_bench.tree_builders(target, noisy, {"c": DominoTreeConfig(budget=6)})
    short = [5, 9, 2, 30, 7, 1]  # a prompt of 4 and an answer of 2 < K drafts
    assert tree_accept_bench.response_accepts(target, noisy, builders, short, 4) == {"c": []}
    assert tree_accept_bench.greedy_rounds([]) == (0, 0)
