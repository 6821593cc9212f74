"""benchmarks/divergence_probe.py end to end on this CPU with the real pair in float32:
every config's greedy output is the target's own (so the probe reports no divergence),
and each config ran with its engine arguments."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_dominotree.training.smollm2 import DRAFTER_DIR

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from divergence_probe import CONFIG_SUFFIXES, first_divergences  # noqa: E402
from variants import split_suffixes  # noqa: E402

pytestmark = pytest.mark.slow


def test_configs_name_their_engine_arguments_and_environment():
    assert split_suffixes("conditional-sync-b4", CONFIG_SUFFIXES) == (
        "conditional",
        {"async_scheduling": False, "max_num_seqs": 4},
        {},
    )
    assert split_suffixes("chain-paths", CONFIG_SUFFIXES) == (
        "chain",
        {},
        {"DOMINOTREE_CUDA_TREE_ATTENTION": "paths"},
    )
    assert split_suffixes("conditional-fixup-check", CONFIG_SUFFIXES) == (
        "conditional",
        {"enforce_eager": True},
        {"DOMINOTREE_CUDA_TREE_ATTENTION": "fixup", "DOMINOTREE_CHECK_TREE_ATTENTION": "1"},
    )


def test_first_divergences_finds_where_outputs_leave_the_target():
    want = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert first_divergences([[1, 2, 3], [4, 0, 6], [0, 8, 0]], want) == {1: 1, 2: 0}
    assert first_divergences(want, want) == {}


def test_probe_finds_no_divergence_in_float32(smollm2_dir, tmp_path):
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "divergence_probe.py"),
        *("--target", str(smollm2_dir), "--drafter", str(DRAFTER_DIR), "--out", str(tmp_path)),
        *("--dtype", "float32", "--prompts", "4", "--max-tokens", "24", "--budget", "8"),
        *("--enforce-eager", "--configs", "conditional", "chain-b4"),
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads((tmp_path / "divergence_probe.json").read_text())["rows"]
    assert [r["config"] for r in rows] == ["conditional", "chain-b4"]
    for row in rows:
        assert row["diverged"] == {}, row
        assert row["stats"]["trees"] > 0
    assert rows[0]["stats"]["mean_leaves"] > 1  # the conditional trees branch
    assert rows[1]["stats"]["mean_leaves"] == 1  # chains
