"""The benchmark harness: real prompt sets load, and a run yields its JSON, table, plot."""

from __future__ import annotations

import json
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from vllm_dominotree.datasets import load_dataset

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import harness


@pytest.mark.parametrize(
    "name, count, turns, marker",
    [
        ("humaneval", 164, 1, "```python"),
        ("mtbench", 80, 2, ""),
        ("math500", 311, 1, "\\boxed{}"),
        ("aime24", 30, 1, "\\boxed{}"),
        ("aime25", 15, 1, "\\boxed{}"),
    ],
)
def test_builtin_datasets(name, count, turns, marker):
    conversations = load_dataset(name)
    assert len(conversations) == count
    assert all(len(c) == turns and all(isinstance(t, str) and t for t in c) for c in conversations)
    assert all(marker in c[0] for c in conversations)


def test_a_run_reports_accept_length_speedup_and_a_plot(pair_dirs, tmp_path):
    data = tmp_path / "mine.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p}) for p in
                              ["the quick brown fox", "abc", "Hello there", "x y z"]))  # fmt: skip
    args = Namespace(target=pair_dirs["target"], drafter=pair_dirs["drafter"], dtype="float32",
                     max_model_len=256, max_new_tokens=24, enforce_eager=True)  # fmt: skip
    datasets = {"mine": load_dataset(f"mine={data}")}
    results = {m: harness.run_method(m, args, datasets) for m in ("no-spec", "conditional-16")}
    rows = {r["method"]: r for r in harness.summarize(results)}
    assert rows["no-spec"]["accept_length"] == 1.0 and rows["no-spec"]["speedup"] == 1.0
    tree = rows["conditional-16"]
    assert tree["accept_length"] > 1.5
    low, high = tree["speedup_ci"]
    assert low <= tree["speedup"] <= high
    assert [r["tokens"] for r in results["conditional-16"]["mine"]] == [24] * 4
    harness.plot(list(rows.values()), tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 10_000
