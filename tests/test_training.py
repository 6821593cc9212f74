"""Training a Domino drafter: loss falls, acceptance rises, chunks resume."""

from __future__ import annotations

import json

import torch

from vllm_dominotree.config import DominoTreeConfig
from vllm_dominotree.drafter import Drafter, read_spec
from vllm_dominotree.reference import ReferenceDecoder
from vllm_dominotree.training import Trainer, load_sequences

OPTIONS = dict(block_size=6, layers=1, gru=32, emb=32, lr=3e-3, seed=0, device="cpu")


def self_distilled(target, path, count=24, length=48):
    """The target's own greedy continuations of random prompts (the training data)."""
    gen = torch.Generator().manual_seed(5)
    decoder = ReferenceDecoder(target)
    with path.open("w") as f:
        for _ in range(count):
            prompt = torch.randint(0, 63, (int(torch.randint(2, 8, (1,), generator=gen)),),
                                   generator=gen).tolist()  # fmt: skip
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
    progress = first.train(data, minutes=5, anchors=4, max_steps=60)
    assert progress["step"] == 60

    # A new process picks up the chunk where it ended: same step count, optimizer state.
    second = Trainer(target_dir, out, **OPTIONS)
    assert second.progress["step"] == 60
    assert second.optimizer.state_dict()["state"], "optimizer state not restored"
    progress = second.train(data, minutes=5, anchors=4, max_steps=120)
    assert progress["step"] == 180
    losses = progress["losses"]
    assert sum(losses[-20:]) / 20 < 0.7 * sum(losses[:20]) / 20

    spec = read_spec(out / "drafter")  # the released format, loadable as any checkpoint
    assert spec.is_domino and spec.shift_label and spec.block_size == 6
    after = mean_accept(attentive_target, out / "drafter")
    print("mean accept length before", before, "after", after)
    assert after > before + 0.5, (before, after)
    assert all(f.stat().st_size <= 16 * 1024 * 1024 for f in out.rglob("*.safetensors"))
