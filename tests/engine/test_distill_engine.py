"""The self-distillation data path end to end: the target answers through vLLM and the
training code reads the result."""

from __future__ import annotations

from vllm_dominotree.training.distill import generate, training_prompts
from vllm_dominotree.training.trainer import load_sequences


def test_generated_data_feeds_training(pair_dirs, tmp_path):
    out = tmp_path / "data.jsonl"
    generate(pair_dirs["target"], training_prompts(4), out, max_tokens=12, dtype="float32")
    rows = load_sequences(out)
    assert len(rows) == 4
    for tokens, prompt_len in rows:
        assert 0 < prompt_len < len(tokens) <= prompt_len + 12
