"""The SmolLM2 target: the converted folder is the packaged model, token for token."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from vllm_dominotree.reference import ReferenceDecoder
from vllm_dominotree.smollm2 import convert, load_gguf


def test_converted_copy_generates_like_the_gguf(tmp_path):
    out = convert(tmp_path / "smollm2")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert config["num_hidden_layers"] == 30 and config["vocab_size"] == 49152

    original, tokenizer = load_gguf()
    copy = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    copy_tokenizer = AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "Name three colors."}]
    text = copy_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=False)  # fmt: skip
    prompt = copy_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert prompt == tokenizer(text, add_special_tokens=False)["input_ids"]
    want = ReferenceDecoder(original).generate(prompt, 24).tokens
    got = ReferenceDecoder(copy).generate(prompt, 24).tokens
    assert got == want
    assert len(copy_tokenizer.decode(got).split()) > 2  # real text, not a degenerate loop
