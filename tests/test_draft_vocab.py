"""The draft vocabulary: its ranking file, the option, the scorers over it, the decoder."""

from __future__ import annotations

import shutil

import pytest
import torch
from tree_helpers import random_domino_checkpoint, random_step

from vllm_dominotree.config import CPU_DRAFT_VOCAB, DominoTreeConfig, DominoTreeConfigError
from vllm_dominotree.demo.toy_pair import PairSpec
from vllm_dominotree.drafter import Drafter
from vllm_dominotree.drafter.checkpoint import DrafterFormatError
from vllm_dominotree.drafter.draft_vocab import (
    RANKING_TENSOR,
    draft_vocab_ids,
    ranking_path,
    read_ranking,
    write_ranking,
)
from vllm_dominotree.reference import ReferenceDecoder
from vllm_dominotree.speculative import translate
from vllm_dominotree.training.draft_vocab import (
    coverage,
    held_out_coverage,
    rank_tokens,
    token_counts,
)
from vllm_dominotree.tree import DeviceTreeBuilder, TreeShape, build_trees, make_scorer

V, K = 40, 5


def test_tokens_rank_by_answer_count_then_id_with_forced_tokens_first():
    sequences = [([7, 7, 1, 3, 3, 5], 2), ([9, 5, 3], 1)]  # prompts [7, 7] and [9]
    counts = token_counts(sequences, vocab_size=10)
    assert counts.tolist() == [0, 1, 0, 3, 0, 2, 0, 0, 0, 0]  # answers only
    # Then the unseen, in id order (a byte-pair vocabulary's merge order).
    assert rank_tokens(counts).tolist() == [3, 5, 1, 0, 2, 4, 6, 7, 8, 9]
    assert rank_tokens(counts, always=[8]).tolist() == [8, 3, 5, 1, 0, 2, 4, 6, 7, 9]
    # Equal counts keep id order.
    assert rank_tokens(torch.tensor([2, 0, 2, 1])).tolist() == [0, 2, 3, 1]
    assert coverage(counts, rank_tokens(counts), [1, 2, 9]) == {1: 0.5, 2: 5 / 6, 9: 1.0}
    # Ranked on the first answer ([1, 3, 3, 5]: 3 first), counted on the second ([3]).
    sequences.append(([0, 4, 4], 1))  # counted against the first answer's ranking
    assert held_out_coverage(sequences, 10, [], [1, 3]) == {1: 0.5, 3: 0.5}


def test_the_ranking_file_is_checked_and_read_in_id_order(tmp_path):
    with pytest.raises(DrafterFormatError, match=r"training\.draft_vocab --data .* --target"):
        read_ranking(tmp_path, 10)
    write_ranking(tmp_path, torch.tensor([6, 2, 9, 0]))
    assert draft_vocab_ids(tmp_path, 3, 10).tolist() == [2, 6, 9]  # the first 3, sorted
    with pytest.raises(DrafterFormatError, match="draft_vocab <= 4"):
        draft_vocab_ids(tmp_path, 5, 10)
    with pytest.raises(DrafterFormatError, match=r"\[0, 9\)"):
        read_ranking(tmp_path, 9)
    write_ranking(tmp_path, torch.tensor([1, 2, 1]))
    with pytest.raises(DrafterFormatError, match="more than once"):
        read_ranking(tmp_path, 10)
    from safetensors.torch import save_file

    save_file({RANKING_TENSOR: torch.tensor([1.0, 2.0])}, str(ranking_path(tmp_path)))
    with pytest.raises(DrafterFormatError, match="int64"):
        read_ranking(tmp_path, 10)
    # Out of the files vLLM loads as weights from a checkpoint without an index: every
    # `*.safetensors` at its top (an engine on a single-file drafter with a ranking there
    # stopped at the unknown tensor; tests/engine/test_round_cost_bench.py runs one).
    assert ranking_path(tmp_path).is_file() and not list(tmp_path.glob("*.safetensors"))


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    """A Domino checkpoint with random weights (vocabulary V), no ranking yet."""
    return random_domino_checkpoint(tmp_path_factory.mktemp("drafter"), V, K)


def test_the_option_is_validated_and_defaults_per_device_and_drafter(
    drafter_dir, tmp_path, monkeypatch
):
    with pytest.raises(DominoTreeConfigError, match="draft_vocab must be 0"):
        DominoTreeConfig(draft_vocab=-1)
    with pytest.raises(DominoTreeConfigError, match="draft_vocab must be 0"):
        DominoTreeConfig(draft_vocab=True)
    user = {"method": "dominotree", "model": str(drafter_dir)}
    # No ranking: the whole vocabulary, and asking for one names the missing file.
    assert translate(user, on_cpu=True)[1]["draft_vocab"] == 0
    with pytest.raises(
        DominoTreeConfigError, match=r"'draft_vocab'.*draft_vocab/ranking\.safetensors"
    ):
        translate({**user, "draft_vocab": 8}, on_cpu=True)
    ranked = shutil.copytree(drafter_dir, tmp_path / "ranked")
    write_ranking(ranked, torch.arange(30))
    user = {"method": "dominotree", "model": str(ranked)}
    # The CPU's preferred size, or every ranked token if the ranking holds fewer; CUDA: all.
    assert CPU_DRAFT_VOCAB > 30 and translate(user, on_cpu=True)[1]["draft_vocab"] == 30
    monkeypatch.setattr("vllm_dominotree.speculative.CPU_DRAFT_VOCAB", 16)
    assert translate(user, on_cpu=True)[1]["draft_vocab"] == 16
    assert translate(user, on_cpu=False)[1]["draft_vocab"] == 0
    assert translate({**user, "scorer": "chain"}, on_cpu=False)[1]["draft_vocab"] == 0
    write_ranking(ranked, torch.arange(V))  # every token ranked
    assert translate({**user, "draft_vocab": 12}, on_cpu=False)[1]["draft_vocab"] == 12
    # A preferred size that leaves no token out: the whole vocabulary, no gather.
    monkeypatch.setattr("vllm_dominotree.speculative.CPU_DRAFT_VOCAB", V)
    assert translate(user, on_cpu=True)[1]["draft_vocab"] == 0
    with pytest.raises(DominoTreeConfigError, match=f"draft_vocab <= {V}"):
        translate({**user, "draft_vocab": V + 1}, on_cpu=False)


def as_tuples(trees):
    return [(t.tokens, t.parents, t.depths, t.children) for t in trees]


# (scorer kind, candidates M, tree shape): M 6 restricts to a top-M, M V does not (the
# conditional scorer corrects the whole draft vocabulary); the chain is one path.
CASES = {
    "conditional-top-M": ("conditional", 6, TreeShape(budget=12, max_depth=K, max_children=3)),
    "conditional-all": ("conditional", V, TreeShape(budget=12, max_depth=K, max_children=3)),
    "marginal": ("marginal", V, TreeShape(budget=12, max_depth=K, max_children=3)),
    "chain": ("chain", V, TreeShape(budget=K, max_depth=K, max_children=1)),
}


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("case", CASES)
def test_a_draft_vocabulary_drafts_as_the_whole_one_would_without_the_other_tokens(
    drafter_dir, case, seed
):
    """Over S of the V tokens (logits [R, K, S]) every scorer builds the trees it builds
    over the whole vocabulary when the other tokens' logits are -inf, with the same scores;
    both builders. So the option changes which tokens may be drafted and nothing else."""
    kind, candidates, shape = CASES[case]
    head = Drafter.load(drafter_dir).head
    hidden, base, embed, anchors = random_step(head.hidden_size, V, K, 3, seed)
    vocab_ids = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:24].sort().values
    outside = torch.ones(V, dtype=torch.bool)
    outside[vocab_ids] = False

    def trees(vocab_ids, logits):
        scorer = make_scorer(
            kind,
            head,
            embed,
            shape=shape,
            candidates=candidates,
            prefix_len=1,
            max_requests=4,
            vocab_ids=vocab_ids,
        )
        scorer.prepare(hidden, logits)
        host = build_trees(scorer, anchors, shape)
        builder = DeviceTreeBuilder(
            scorer, shape, chain=kind == "chain", device=torch.device("cpu"), max_requests=4
        )
        device = builder.build(torch.tensor(anchors))
        assert as_tuples(device) == as_tuples(host)
        return host

    over_subset = trees(vocab_ids, base[..., vocab_ids])
    over_all = trees(None, base.masked_fill(outside, float("-inf")))
    assert as_tuples(over_subset) == as_tuples(over_all)
    for a, b in zip(over_subset, over_all, strict=True):
        assert a.scores == pytest.approx(b.scores, abs=1e-5)
        assert all(not outside[t] for t in a.tokens[1:]), "a token outside was drafted"
        assert a.num_nodes - 1 == shape.budget


def test_the_decoder_drafts_from_the_vocabulary_and_stays_lossless(toy_pair, tmp_path):
    """The exact toy drafter drafts the target's own tokens. With a draft vocabulary
    that holds them all it accepts as over the whole vocabulary; with one that holds none
    of them it accepts nothing, and the output is the target's either way."""
    target, exact, _, spec = toy_pair
    prompt = [5, 9, 12, 3, 7, 22]
    expected = ReferenceDecoder(target).generate(prompt, 40).tokens
    used = sorted(set(expected[len(prompt) :]))
    unused = [t for t in range(spec.vocab) if t not in used]
    whole = ReferenceDecoder(target, exact, DominoTreeConfig(budget=8)).generate(prompt, 40)
    ranked = shutil.copytree(exact.spec.path, tmp_path / "ranked")
    drafter = Drafter.load(ranked)
    for first, accepts in ((used, "all"), (unused, "none")):
        write_ranking(
            ranked, torch.tensor(first + [t for t in range(spec.vocab) if t not in first])
        )
        config = DominoTreeConfig(budget=8, draft_vocab=len(first))
        got = ReferenceDecoder(target, drafter, config).generate(prompt, 40)
        assert got.tokens == expected
        if accepts == "all":
            assert got.accept_lengths == whole.accept_lengths
            assert got.mean_accept_length > 2
        else:
            assert set(got.accept_lengths) == {1}


def test_the_ranking_command_counts_answers_and_ranks_end_of_sequence_first(
    tmp_path, monkeypatch, capsys
):
    from vllm_dominotree.demo.toy_pair import write_pair
    from vllm_dominotree.training import draft_vocab as command

    target_dir, drafter = write_pair(tmp_path, PairSpec())
    vocab, eos = command.vocabulary_of(target_dir)
    assert vocab == PairSpec().vocab and eos
    data = tmp_path / "data.jsonl"
    data.write_text('{"tokens": [9, 9, 4, 4, 4, 7], "prompt_len": 2}\n')
    argv = ["draft_vocab", "--data", str(data), "--drafter", str(drafter)]
    monkeypatch.setattr("sys.argv", [*argv, "--target", str(target_dir)])
    command.main()
    ranking = read_ranking(drafter, vocab).tolist()
    assert ranking[:3] == [*eos, 4, 7] and sorted(ranking) == list(range(vocab))
    # One answer: nothing is held out.
    assert "first 1024: 100.0000% of them, nan% held out" in capsys.readouterr().out


def test_an_engine_refuses_a_draft_vocabulary_over_a_quantized_lm_head():
    from types import SimpleNamespace

    from vllm_dominotree.engine.drafter_model import DominoDraftForCausalLM

    packed = SimpleNamespace(lm_head=SimpleNamespace(weight=torch.zeros(8, 4, dtype=torch.int8)))
    with pytest.raises(DominoTreeConfigError, match="quantized; set draft_vocab 0"):
        DominoDraftForCausalLM.use_draft_vocab(packed, torch.arange(4), 8)
    # (A plain lm_head: tests/engine/test_smollm2_engine.py, in a real engine.)


def test_an_engines_draft_logits_take_vllms_cpu_gemm(monkeypatch):
    """On CPU the draft vocabulary's product runs by vLLM's own GEMM dispatch (oneDNN
    here: 7x torch's F.linear at decode sizes, drafter_model._product_by), and gives the
    lm_head's rows' logits, soft cap and scale applied as vLLM applies them."""
    from types import SimpleNamespace

    import vllm.model_executor.layers.utils as vllm_utils

    from vllm_dominotree.engine import drafter_model

    dispatched, dispatch = [], vllm_utils.dispatch_cpu_unquantized_gemm

    def recording_dispatch(layer, remove_weight):
        dispatched.append(tuple(layer.weight.shape))
        return dispatch(layer, remove_weight)

    monkeypatch.setattr(vllm_utils, "dispatch_cpu_unquantized_gemm", recording_dispatch)
    monkeypatch.setattr(drafter_model, "_whole_vocab", lambda table, vocab: table[:vocab])
    weight = torch.randn(300, 64, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([5, 0, 299, 17, 42])
    for soft_cap, scale in ((None, 1.0), (30.0, 0.5)):
        model = SimpleNamespace(
            lm_head=SimpleNamespace(weight=weight),
            logits_processor=SimpleNamespace(soft_cap=soft_cap, scale=scale),
        )
        drafter_model.DominoDraftForCausalLM.use_draft_vocab(model, ids, 300)
        rows = torch.randn(12, 64)
        logits = drafter_model.DominoDraftForCausalLM.draft_logits(model, rows)
        expected = rows @ weight[ids].T
        if soft_cap is not None:
            expected = torch.tanh(expected / soft_cap) * soft_cap
        torch.testing.assert_close(logits, expected * scale, rtol=1e-5, atol=1e-4)
    assert dispatched == [(5, 64), (5, 64)]
