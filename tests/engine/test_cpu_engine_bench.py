"""benchmarks/cpu_engine_bench.py end to end on the toy pair (CPU): both methods run in
vLLM in both modes, the plugin's stage clock is read per mode, and the output equals the
engine without speculation; each mode timed twice. Timings are not checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_cpu_engine_bench_reads_the_stage_clock_per_mode(tmp_path):
    command = [sys.executable, str(ROOT / "benchmarks" / "cpu_engine_bench.py")]
    command += ["--out", str(tmp_path), "--name", "run", "--pair", "toy", "--prompts", "2"]
    command += ["--max-tokens", "12", "--methods", "no-spec", "conditional-b2"]
    command += ["--repeats", "2"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = {r["method"]: r for r in json.loads((tmp_path / "run.json").read_text())["rows"]}
    assert set(rows) == {"no-spec", "conditional-b2"}
    for mode in ("batch", "single"):
        assert set(rows["no-spec"][f"{mode}_stage_ms"]) == {"step"}
        stages = rows["conditional-b2"][f"{mode}_stage_ms"]
        assert set(stages) == {"verify", "draft", "build", "accept", "step"}
        # every stage ran, inside its step
        assert 0 < stages["verify"] < stages["step"] and stages["build"] > 0
    assert rows["conditional-b2"]["equals_no_spec"] is True
    assert rows["conditional-b2"]["tree_stats"]["trees"] > 0
    assert "batch ms: verify / draft / build / accept / step" in (tmp_path / "run.md").read_text()
    # each mode's runs kept, tokens/s from their median
    for row in rows.values():
        assert len(row["batch_runs_s"]) == len(row["single_runs_s"]) == 2, row
    assert json.loads((tmp_path / "run.json").read_text())["meta"]["repeats"] == 2
