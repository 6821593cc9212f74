"""Training a Domino drafter: loss falls, acceptance rises, chunks resume."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F

from vllm_dominotree.config import DominoTreeConfig
from vllm_dominotree.drafter import Drafter, read_spec
from vllm_dominotree.drafter.checkpoint import load_tensors
from vllm_dominotree.reference import ReferenceDecoder
from vllm_dominotree.training.evaluate import (
    chain_runs,
    draft_accuracy,
    first_anchor,
    over,
    sequence_runs,
)
from vllm_dominotree.training.trainer import Trainer, block_logits, load_sequences, make_batch

OPTIONS = dict(
    block_size=6, layers=1, target_layers=2, gru=32, emb=32, lr=3e-3, seed=0, device="cpu", warmup=5
)


def self_distilled(target, path, count=24, length=48):
    """The target's own greedy continuations of random prompts (the training data)."""
    gen = torch.Generator().manual_seed(5)
    decoder = ReferenceDecoder(target)
    with path.open("w") as f:
        for _ in range(count):
            prompt = torch.randint(
                0, 63, (int(torch.randint(2, 8, (1,), generator=gen)),), generator=gen
            ).tolist()
            tokens = prompt + decoder.generate(prompt, length).tokens
            f.write(json.dumps({"tokens": tokens, "prompt_len": len(prompt)}) + "\n")
    return load_sequences(path)


def mean_accept(target, drafter_dir) -> float:
    decoder = ReferenceDecoder(target, Drafter.load(str(drafter_dir)), DominoTreeConfig(budget=8))
    lengths = []
    for prompt in ([3, 17], [40, 2, 9], [11]):
        lengths += decoder.generate(prompt, 40).accept_lengths
    return sum(lengths) / len(lengths)


def test_training_improves_the_drafter_and_resumes(attentive_target, tmp_path):
    target_dir = attentive_target.name_or_path
    data = self_distilled(attentive_target, tmp_path / "data.jsonl")
    out = tmp_path / "run"

    first = Trainer(target_dir, out, **OPTIONS)
    first.save()  # the untrained drafter, for comparison
    before = mean_accept(attentive_target, out / "drafter")
    progress = first.train(data, minutes=5, batch_size=2, anchors=4, max_steps=60)
    assert progress["step"] == 60

    # A new process picks up the chunk where it ended: same step count, optimizer state.
    second = Trainer(target_dir, out, **OPTIONS)
    assert second.progress["step"] == 60
    assert second.optimizer.state_dict()["state"], "optimizer state not restored"
    progress = second.train(data, minutes=5, batch_size=2, anchors=4, max_steps=120)
    assert progress["step"] == 180
    losses = progress["losses"]
    assert sum(losses[-20:]) / 20 < 0.7 * sum(losses[:20]) / 20

    spec = read_spec(out / "drafter")  # the released format, loadable as any checkpoint
    assert spec.is_domino and spec.shift_label and spec.block_size == 6
    after = mean_accept(attentive_target, out / "drafter")
    print("mean accept length before", before, "after", after)
    assert after > before + 0.5, (before, after)
    assert all(f.stat().st_size <= 16 * 1024 * 1024 for f in out.rglob("*.safetensors"))
    for folder, prefix in ((out / "drafter", "model"), (out / "state", "optimizer")):
        index = json.loads((folder / f"{prefix}.safetensors.index.json").read_text())
        on_disk = {f.name for f in folder.glob("*.safetensors")}
        assert on_disk == set(index["weight_map"].values()), "stale shards left behind"


def test_a_new_run_starts_from_a_released_drafter(attentive_target, tmp_path):
    """--init-from: a machine without the run's state trains on from the shipped drafter
    (its bfloat16 weights, exactly, and its architecture over the options'); a drafter
    of another target is refused with the reason."""
    target_dir = attentive_target.name_or_path
    data = self_distilled(attentive_target, tmp_path / "data.jsonl", count=6, length=24)
    first = Trainer(target_dir, tmp_path / "first", **OPTIONS)
    first.train(data, minutes=5, batch_size=2, anchors=4, max_steps=10)
    shipped = first.export(tmp_path / "shipped")  # bfloat16, as the package ships it

    other = OPTIONS | {"gru": 16, "emb": 8, "block_size": 4}  # overruled by the drafter
    run = Trainer(target_dir, tmp_path / "run", **other, init_from=shipped)
    assert run.progress["step"] == 0 and not run.optimizer.state_dict()["state"]
    assert run.spec.gru_hidden_dim == 32 and run.spec.block_size == 6
    expected = load_tensors(read_spec(shipped))
    assert set(expected) == set(run.spec.expected_shapes())
    for name, tensor in run._tensors(torch.float32).items():
        assert torch.equal(tensor, expected[name].float()), name
    progress = run.train(data, minutes=5, batch_size=2, anchors=4, max_steps=5)
    assert progress["step"] == 5 and len(progress["losses"]) == 5
    # A later chunk resumes the run itself; --init-from no longer applies.
    again = Trainer(target_dir, tmp_path / "run", **OPTIONS, init_from=tmp_path / "missing")
    assert again.progress["step"] == 5

    config = json.loads((shipped / "config.json").read_text())
    config["hidden_size"] = 2 * config["hidden_size"]
    (shipped / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="a drafter for another target"):
        Trainer(target_dir, tmp_path / "refused", **OPTIONS, init_from=shipped)


def test_a_run_deepens_a_released_drafter(attentive_target, tmp_path):
    """--draft-layers above the released drafter's: the new layer starts silent, so the
    deeper drafter's blocks are the drafter's own; it trains, and its export loads and
    drafts at that depth. Fewer layers than the drafter's are refused."""
    target_dir = attentive_target.name_or_path
    data = self_distilled(attentive_target, tmp_path / "data.jsonl", count=6, length=24)
    first = Trainer(target_dir, tmp_path / "first", **OPTIONS)
    first.train(data, minutes=5, batch_size=2, anchors=4, max_steps=10)
    shipped = first.export(tmp_path / "shipped")

    same = Trainer(target_dir, tmp_path / "same", **OPTIONS | {"layers": None}, init_from=shipped)
    deep = Trainer(target_dir, tmp_path / "deep", **OPTIONS | {"layers": 3}, init_from=shipped)
    assert (same.spec.num_layers, deep.spec.num_layers) == (1, 3)
    batch = make_batch(data, deep.spec.num_drafts, 5, 1024, random.Random(1))
    with torch.no_grad():
        before = block_logits(same.target, same.drafter, batch, same.device)
        after = block_logits(deep.target, deep.drafter, batch, deep.device)
    assert torch.equal(before.base, after.base) and torch.equal(before.corrected, after.corrected)

    start = {n: t.clone() for n, t in deep._tensors(torch.float32).items()}
    deep.train(data, minutes=5, batch_size=2, anchors=4, max_steps=3)
    trained = deep._tensors(torch.float32)
    for i in (1, 2):  # every new layer learns, its silent projections first
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight", "self_attn.q_proj.weight"):
            assert not torch.equal(trained[f"layers.{i}.{name}"], start[f"layers.{i}.{name}"])
    exported = deep.export(tmp_path / "deep_export")
    config = json.loads((exported / "config.json").read_text())
    assert config["num_hidden_layers"] == 3 and len(config["layer_types"]) == 3
    assert read_spec(exported).num_layers == 3 and mean_accept(attentive_target, exported) >= 1

    with pytest.raises(ValueError, match="add layers to it, not drop them"):
        Trainer(target_dir, tmp_path / "shallower", **OPTIONS | {"layers": 2}, init_from=exported)


def anchor_loss(trainer: Trainer, tokens: list[int], p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One anchor's two loss terms the plain way: the serving block (block_hidden) over
    the context before p, the GRU stepped token by token. Returns per-row CE [K], [K]."""
    drafter, spec = trainer.drafter, trainer.spec
    embed = trainer.target.get_input_embeddings().weight
    ids = torch.tensor(tokens)
    with torch.no_grad():
        hidden = trainer.target(ids[None], output_hidden_states=True).hidden_states
    features = torch.cat([hidden[i + 1][0, :p] for i in spec.target_layer_ids], -1)
    context = drafter.backbone.context_kv(features, torch.arange(p))
    rows = drafter.block_hidden(embed[ids[p]], embed[spec.mask_token_id], p, context)
    labels = ids[p + 1 : p + 1 + spec.num_drafts]
    base = trainer.target.get_output_embeddings()(rows)
    state = drafter.head.initial_state(embed[ids[p]][None])
    states = [state]
    for i in range(1, spec.num_drafts):
        state = drafter.head.gru_step(embed[ids[p + i]][None], state)
        states.append(state)
    corrected = base + drafter.head.correction(rows, torch.cat(states))
    ce = lambda logits: F.cross_entropy(logits, labels, reduction="none")
    return ce(base), ce(corrected)


@pytest.mark.parametrize("decay", [None, 3.0])
def test_batched_loss_equals_per_anchor_blocks(attentive_target, tmp_path, decay):
    """Many anchors of several sequences side by side under one mask give exactly the
    loss of running each anchor's block alone, as serving does (a mask that lets a block
    see another block or a later context position fails this)."""
    target_dir = attentive_target.name_or_path
    data = self_distilled(attentive_target, tmp_path / "data.jsonl", count=3, length=30)
    trainer = Trainer(target_dir, tmp_path / "run", **(OPTIONS | {"seed": 3}), decay=decay)
    # A trained-looking head: the correction must not be zero, or it would hide errors.
    torch.nn.init.normal_(trainer.drafter.head.proj_out, std=0.3)
    batch = make_batch(data, trainer.spec.num_drafts, 5, 1024, random.Random(1))
    assert batch.valid.all() and len(set(batch.tokens.shape)) == 2
    weights = trainer.row_weights()
    start = trainer.spec.pure_draft_prefix_len
    base_terms, corrected_terms = [], []
    for b, (tokens, _) in enumerate(data):
        for p in batch.anchors[b].tolist():
            base, corrected = anchor_loss(trainer, tokens, p)
            base_terms.append(base * weights)
            corrected_terms.append(corrected[start:] * weights[start:])
    expected = 0.5 * (
        torch.cat(base_terms).sum() / (weights.sum() * len(base_terms))
        + torch.cat(corrected_terms).sum() / (weights[start:].sum() * len(corrected_terms))
    )
    assert torch.allclose(trainer.loss(batch), expected, rtol=1e-5), (trainer.loss(batch), expected)


def test_drafter_config_takes_the_targets_rope_base(smollm2_dir):
    """SmolLM2 keeps rope_theta = 100000 in rope_parameters (transformers 5); the drafter
    layers copied from it must rotate the same way."""
    from transformers import AutoConfig

    from vllm_dominotree.training.trainer import drafter_config

    config = drafter_config(
        AutoConfig.from_pretrained(smollm2_dir),
        block_size=16,
        layers=1,
        target_layers=4,
        gru=8,
        emb=8,
        mask_token_id=2,
    )
    assert config["rope_theta"] == 100000.0
    assert config["dflash_config"]["target_layer_ids"] == [1, 10, 18, 27]


def test_offline_accuracy_is_what_the_chain_rounds_accept(toy_pair):
    """The evaluator's teacher-forced run of right drafts at an anchor is what a chain
    round anchored there commits: checked against the reference decoder's rounds."""
    target, _, noisy, _ = toy_pair
    prompt = [5, 9, 2, 30]
    result = ReferenceDecoder(target, noisy, DominoTreeConfig(scorer="chain")).generate(prompt, 80)
    tokens = prompt + result.tokens
    runs = chain_runs(target, noisy, tokens, len(prompt))
    k, p, checked = noisy.spec.num_drafts, len(prompt), []
    for accepted in result.accept_lengths:
        if p + k < len(tokens):  # the round's whole block lies inside the tokens
            checked.append(accepted - 1)
            assert runs["corrected"][p - first_anchor(len(prompt))] == accepted - 1
        p += accepted
    assert len(checked) >= 5 and 0 < sum(checked) < k * len(checked)  # runs of every kind
    accuracy = draft_accuracy(target, noisy, [(tokens, len(prompt))])
    assert accuracy.anchors == len(runs["corrected"]) == len(tokens) - k - len(prompt) + 1
    assert accuracy.chain_accept_corrected == pytest.approx(1 + runs["corrected"].float().mean())
    # An answer shorter than a block has no anchor and counts for nothing (on the H200 a
    # 25-prompt set held one and the evaluator stopped on it).
    short = prompt + result.tokens[: k - 1]
    assert len(chain_runs(target, noisy, short, len(prompt))["corrected"]) == 0
    both = draft_accuracy(target, noisy, [(short, len(prompt)), (tokens, len(prompt))])
    assert both == accuracy


def test_one_drafter_over_another_pairs_the_responses(toy_pair):
    """The evaluator's comparison: the exact drafter over the noisy one on the same
    responses is a ratio above 1 with an interval above 1; a drafter over itself is 1."""
    target, exact, noisy, _ = toy_pair
    prompts = [[5, 9, 2, 30], [7, 1, 4], [11, 3, 8, 8, 2]]
    decoder = ReferenceDecoder(target, noisy, DominoTreeConfig(scorer="chain"))
    sequences = [(p + decoder.generate(p, 40).tokens, len(p)) for p in prompts]
    runs = {d: sequence_runs(target, d, sequences) for d in (exact, noisy)}
    better = over(runs[exact], runs[noisy])
    assert better["chain_accept_ratio"] > 1 and better["chain_accept_ratio_ci"][0] > 1
    assert better["first_draft_ratio"] >= 1
    same = over(runs[noisy], runs[noisy])
    assert same["chain_accept_ratio"] == 1 and same["chain_accept_ratio_ci"] == (1, 1)
