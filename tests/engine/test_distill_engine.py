"""The self-distillation data path end to end: prompts the target writes itself, its
answers through vLLM, and the training code reading the result."""

from __future__ import annotations

import pytest

from vllm_dominotree.training.distill import (
    answer,
    evaluation_texts,
    overlap,
    self_written_prompts,
    training_prompts,
)
from vllm_dominotree.training.trainer import load_sequences

from .conftest import make_llm, shutdown


def test_answers_feed_training(pair_dirs, tmp_path):
    out = tmp_path / "data.jsonl"
    llm = make_llm(pair_dirs)
    answer(llm, training_prompts(4), out, max_tokens=12)
    shutdown(llm)
    rows = load_sequences(out)
    assert len(rows) == 4 and not out.with_name("data.jsonl.partial").exists()
    for tokens, prompt_len in rows:
        assert 0 < prompt_len < len(tokens) <= prompt_len + 12


@pytest.mark.slow
def test_smollm2_writes_its_own_prompts(smollm2_dir):
    """User turns SmolLM2 writes from its chat template's user-turn prefix: distinct,
    ended by the model, not benchmark text, and not the templates' few kinds."""
    llm = make_llm({"target": str(smollm2_dir)}, dtype="bfloat16", max_model_len=512)
    prompts = self_written_prompts(llm, 24)
    shutdown(llm)
    assert len(set(prompts)) == 24
    assert all(20 <= len(p) <= 1000 and "<|im_" not in p for p in prompts)
    assert overlap(prompts, evaluation_texts()) == []
    assert len({p.split()[0].lower() for p in prompts}) >= 6  # many kinds of request
