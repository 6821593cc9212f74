"""The benchmark harness: real prompt sets load, and a run yields its JSON, table, plot."""

from __future__ import annotations

import json
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from vllm_dominotree.evaluation.datasets import load_dataset

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


def _args(pair_dirs, tmp_path, mode, profile=False):
    return Namespace(
        target=pair_dirs["target"],
        drafter=pair_dirs["drafter"],
        dtype="float32",
        max_model_len=256,
        max_new_tokens=24,
        enforce_eager=True,
        mode=mode,
        out=tmp_path / mode,
        profile=profile,
        candidates=None,
    )


def _datasets(tmp_path):
    data = tmp_path / "mine.jsonl"
    data.write_text(
        "\n".join(
            json.dumps({"prompt": p})
            for p in ["the quick brown fox", "abc", "Hello there", "x y z"]
        )
    )
    return {"mine": load_dataset(f"mine={data}")}


def test_a_run_reports_accept_length_speedup_and_a_plot(pair_dirs, tmp_path):
    args = _args(pair_dirs, tmp_path, "offline", profile=True)
    datasets = _datasets(tmp_path)
    results = {m: harness.run_method(m, args, datasets) for m in ("no-spec", "conditional-16")}
    rows = {r["method"]: r for r in harness.summarize(results)}
    assert rows["no-spec"]["accept_length"] == 1.0 and rows["no-spec"]["speedup"] == 1.0
    tree = rows["conditional-16"]
    assert tree["accept_length"] > 1.5
    low, high = tree["speedup_ci"]
    assert low <= tree["speedup"] <= high
    # Decode tokens: all but the first (which prefill makes), in positive decode time.
    records = results["conditional-16"]["mine"]
    assert [r["tokens"] for r in records] == [23] * 4 and all(r["seconds"] > 0 for r in records)
    # --profile: the tree runner's stage clock, per verification step (no-spec has none).
    assert all(r["steps"] > 0 and r["verify_s"] > 0 and r["build_s"] > 0 for r in records)
    assert "stage_ms_per_step" not in rows["no-spec"]
    stages = tree["stage_ms_per_step"]
    assert set(stages) == {"prepare", "verify", "accept", "draft", "build", "step"}
    parts = ("prepare", "verify", "accept", "draft", "build")
    assert sum(stages[k] for k in parts) < stages["step"]
    assert tree["leaves_per_tree"] > 1.0
    table = harness.report(results, args)
    assert "conditional-16" in table and (args.out / "harness.md").read_text() == table
    assert "Stage clock" in table
    assert json.loads((args.out / "harness.json").read_text())["records"] == results
    assert (args.out / "harness.png").stat().st_size > 10_000


def test_server_mode_measures_over_http(pair_dirs, tmp_path):
    """The same protocol against vLLM's OpenAI-compatible server: streaming chat
    completions, acceptance from the server's /metrics."""
    args = _args(pair_dirs, tmp_path, "server")
    records = harness.run_method("conditional-16", args, _datasets(tmp_path))["mine"]
    assert [r["tokens"] for r in records] == [23] * 4 and all(r["seconds"] > 0 for r in records)
    assert harness.accept_length(records) > 1.5
    assert "dominotree" in (args.out / "server-conditional-16.log").read_text()
