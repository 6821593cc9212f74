"""Self-distillation prompts: many, distinct, and provably not evaluation prompts."""

from __future__ import annotations

from vllm_dominotree.evaluation.datasets import load_dataset
from vllm_dominotree.training.distill import (
    evaluation_texts,
    overlap,
    training_prompts,
    user_turn_prefix,
)


def test_prompts_are_distinct_deterministic_and_varied():
    prompts = training_prompts(3000, seed=1)
    assert len(set(prompts)) == 3000
    assert prompts[:50] == training_prompts(50, seed=1)
    assert len({p.split()[0] for p in prompts}) >= 5  # several kinds of task


def test_no_training_prompt_shares_an_8_gram_with_the_evaluation_sets():
    texts = evaluation_texts()
    assert len(texts) == 164 + 2 * 80 + 311 + 30 + 15
    assert overlap(training_prompts(3000, seed=0), texts) == []


def test_the_overlap_check_finds_a_leaked_prompt():
    leaked = load_dataset("mtbench")[3][0]
    hits = overlap([*training_prompts(20), leaked], evaluation_texts())
    assert [i for i, _ in hits] == [20]


def test_user_turn_prefix_is_the_template_up_to_the_users_text(smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prefix = user_turn_prefix(tokenizer)
    assert prefix.endswith("<|im_start|>user\n") and prefix.count("<|im_start|>") == 2
    text = "Name three colors."
    full = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    assert full.startswith(prefix + text)


def test_the_kept_answers_prompts_share_no_8_gram_with_the_evaluation_sets(smollm2_dir):
    """data/smollm2 (answers kept for later training chunks, and held out for fitting the
    score temperatures): every prompt's user turn, decoded from its tokens, passes the
    same check; and the check sees those turns (a leaked evaluation prompt among them is
    found)."""
    import json
    import lzma
    from pathlib import Path

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prefix = user_turn_prefix(tokenizer)
    turns = []
    kept = Path(__file__).parents[1] / "data" / "smollm2"
    for path in sorted([*kept.glob("answers-*.jsonl.xz"), *kept.glob("heldout-*.jsonl.xz")]):
        with lzma.open(path, "rt") as rows:
            for line in rows:
                row = json.loads(line)
                text = tokenizer.decode(row["tokens"][: row["prompt_len"]])
                assert text.startswith(prefix), text[:200]
                turns.append(text[len(prefix) :].split("<|im_end|>")[0])
    assert len(turns) >= 5000 and len(set(turns)) > 0.95 * len(turns)
    texts = evaluation_texts()
    assert overlap(turns, texts) == []
    assert [i for i, _ in overlap([*turns[:50], texts[3]], texts)] == [50]
