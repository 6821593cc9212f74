"""The embedded real pair through vLLM: SmolLM2-135M-Instruct with its trained Domino
drafter, greedy output identical to the target alone (float32, CPU), drafting from the
drafter's draft vocabulary and scoring trees at its fitted temperature, as the CPU does by
default."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from vllm_dominotree.config import CPU_BUDGET, CPU_DRAFT_VOCAB
from vllm_dominotree.drafter.score_temperature import default_temperature
from vllm_dominotree.evaluation.datasets import chat_token_ids
from vllm_dominotree.training.smollm2 import DRAFTER_DIR

from .conftest import greedy, make_llm, shutdown, tree_stats

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Give three tips for sleeping better.",
    "What is 15% of 240? Explain briefly.",
    "Write a haiku about the sea.",
]


def test_smollm2_pair_is_lossless_and_accepts_drafts(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [chat_token_ids(tokenizer, p) for p in PROMPTS]
    dirs = {"target": str(smollm2_dir)}
    llm = make_llm(dirs, max_model_len=1024)
    want = greedy(llm, prompts, max_tokens=64)
    shutdown(llm)
    llm = make_llm(dirs, {"method": "dominotree", "model": str(DRAFTER_DIR)}, max_model_len=1024)
    # One request at a time, as the main command's first run: the CPU's default shares a
    # step's nodes out (config.cpu_step_nodes), so a lone request's tree keeps the budget.
    got = [greedy(llm, [p], max_tokens=64)[0] for p in prompts]
    stats = tree_stats(llm)
    shutdown(llm)
    assert got == want
    print("SmolLM2 pair in vLLM:", stats)
    # The CPU's default: the drafter drafts from its ranking's first CPU_DRAFT_VOCAB tokens.
    assert stats["draft_vocab"] == CPU_DRAFT_VOCAB
    assert stats["candidates"] == 64  # the correction's top M (the default)
    assert stats["budget"] == stats["step_nodes"] == CPU_BUDGET
    # The drafter's fitted score temperature (drafter/score_temperature.py), not 1.
    fitted = default_temperature(DRAFTER_DIR, "conditional")
    assert fitted != 1.0 and stats["score_temperature"] == fitted
    assert stats["mean_accept_length"] > 1.5
    assert stats["sibling_accepts"] > 0  # the tree, not just its first path, pays off
