"""The SmolLM2 pair: the converted folder is the packaged model, token for token, and
the embedded drafter is trained for it."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from vllm_dominotree.config import DominoTreeConfig
from vllm_dominotree.drafter import Drafter, check_fits_target, read_spec
from vllm_dominotree.evaluation.datasets import chat_token_ids
from vllm_dominotree.reference import ReferenceDecoder
from vllm_dominotree.training.smollm2 import DRAFTER_DIR, load_gguf
from vllm_dominotree.training.trainer import initial_tensors

PROMPTS = ["What is 15% of 240? Explain briefly.", "Give three tips for sleeping better."]


def test_converted_copy_generates_like_the_gguf(smollm2_dir):
    out = smollm2_dir
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert config["num_hidden_layers"] == 30 and config["vocab_size"] == 49152

    original, tokenizer = load_gguf()
    copy = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    copy_tokenizer = AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "Name three colors."}]
    text = copy_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    prompt = copy_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert prompt == tokenizer(text, add_special_tokens=False)["input_ids"]
    want = ReferenceDecoder(original).generate(prompt, 24).tokens
    got = ReferenceDecoder(copy).generate(prompt, 24).tokens
    assert got == want
    assert len(copy_tokenizer.decode(got).split()) > 2  # real text, not a degenerate loop


def test_embedded_drafter_is_trained_for_smollm2(smollm2_dir, tmp_path):
    """The shipped drafter fits the target, decodes losslessly in every mode, and accepts
    far more than the same drafter before training (its initial weights)."""
    spec = read_spec(DRAFTER_DIR)
    config = json.loads((smollm2_dir / "config.json").read_text())
    check_fits_target(
        spec,
        hidden_size=config["hidden_size"],
        vocab_size=config["vocab_size"],
        num_layers=config["num_hidden_layers"],
    )
    assert spec.is_domino and spec.block_size == 16
    assert sum(f.stat().st_size for f in DRAFTER_DIR.iterdir()) < 40e6

    target = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    untrained_dir = tmp_path / "untrained"
    untrained_dir.mkdir()
    (untrained_dir / "config.json").write_text((DRAFTER_DIR / "config.json").read_text())
    tensors = initial_tensors(
        json.loads((DRAFTER_DIR / "config.json").read_text()),
        target,
        torch.Generator().manual_seed(0),
    )
    from safetensors.torch import save_file

    save_file(tensors, str(untrained_dir / "model.safetensors"))

    def mean_accept(drafter_dir, scorer):
        decoder = ReferenceDecoder(
            target, Drafter.load(str(drafter_dir)), DominoTreeConfig(scorer=scorer)
        )
        lengths = []
        for prompt in PROMPTS:
            ids = chat_token_ids(tokenizer, prompt)
            result = decoder.generate(ids, 40)
            assert result.tokens == ReferenceDecoder(target).generate(ids, 40).tokens
            lengths += result.accept_lengths
        return sum(lengths) / len(lengths)

    trained = {s: mean_accept(DRAFTER_DIR, s) for s in ("chain", "conditional")}
    untrained = mean_accept(untrained_dir, "conditional")
    print("mean accept length", trained, "untrained conditional", untrained)
    assert untrained < 1.1
    assert trained["conditional"] > 1.5 and trained["chain"] > 1.3
