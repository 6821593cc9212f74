"""benchmarks/builder_bench.py on this CPU: Domino's chain is built as the engine builds
it and its trees are the host heap's (the bench stops otherwise); times are not checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
BENCH = [sys.executable, str(ROOT / "benchmarks" / "builder_bench.py"), "--device", "cpu"]


def test_the_chain_is_timed_beside_the_trees(tmp_path):
    args = ["--out", str(tmp_path), "--rounds", "1", "--batches", "1", "--budgets", "15"]
    args += ["--candidates", "64", "--scorers", "chain", "conditional"]
    run = subprocess.run(BENCH + args, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads((tmp_path / "builder_bench.json").read_text())["rows"]
    assert [(r["scorer"], r["builder"]) for r in rows] == [
        ("chain", "device"),
        ("chain", "host heap"),
        ("conditional", "device"),
        ("conditional", "host heap"),
    ]
    assert all(r["trees_equal_host_heap"] and r["build_ms_median"] > 0 for r in rows)
    # The engine's shapes (budget, depth, children) and builders: a path of 15, a tree.
    assert [(r["tree_shape"], r["builds_a_path"]) for r in rows[::2]] == [
        ([15, 15, 1], True),
        ([15, 15, 15], False),
    ]
    assert "| chain | 1 | 15 | 64 | - | device |" in (tmp_path / "builder_bench.md").read_text()


def test_a_chain_longer_than_the_drafters_block_is_refused(tmp_path):
    args = ["--out", str(tmp_path), "--budgets", "16", "32", "--scorers", "chain"]
    run = subprocess.run(BENCH + args, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert "a chain drafts at most the drafter's 16 slots: --budgets <= 16" in run.stderr
