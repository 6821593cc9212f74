"""The harness's statistics on made-up records (no engine): the row over all sets, the
paired bootstrap, and the head-to-head the paper reports (conditional over marginal)."""

from __future__ import annotations

import json
import sys
from argparse import Namespace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import harness


def _records(tokens: list[int], seconds: list[float], drafts: list[int], accepted: list[int]):
    return [
        {"tokens": t, "seconds": s, "drafts": d, "accepted": a}
        for t, s, d, a in zip(tokens, seconds, drafts, accepted, strict=True)
    ]


def _results() -> dict[str, dict[str, list[dict]]]:
    base = {
        "code": _records([100, 80, 120], [2.0, 2.5, 3.0], [0, 0, 0], [0, 0, 0]),
        "math": _records([60, 90], [1.0, 2.0], [0, 0], [0, 0]),
    }
    # marginal: 1.5x no-spec on every prompt; conditional: 1.2x marginal on every prompt.
    marginal = {
        name: [{**r, "seconds": r["seconds"] / 1.5, "drafts": 10, "accepted": 8} for r in records]
        for name, records in base.items()
    }
    conditional = {
        name: [{**r, "seconds": r["seconds"] / 1.2, "accepted": 12} for r in records]
        for name, records in marginal.items()
    }
    return {"no-spec": base, "marginal": marginal, "conditional-16": conditional}


def test_the_row_over_all_sets_pools_every_prompt():
    results = _results()
    rows = {(r["method"], r["dataset"]): r for r in harness.summarize(results)}
    everything = rows[("no-spec", "all")]
    assert everything["prompts"] == 5
    assert everything["tok_s"] == pytest.approx(450 / 10.5)
    marginal = rows[("marginal", "all")]
    assert marginal["accept_length"] == pytest.approx(1.8)
    assert marginal["speedup"] == pytest.approx(1.5)
    assert marginal["speedup_ci"] == pytest.approx((1.5, 1.5))  # the same ratio per prompt


def test_a_single_set_gets_no_row_over_all():
    results = {m: {"code": r["code"]} for m, r in _results().items()}
    assert {r["dataset"] for r in harness.summarize(results)} == {"code"}


def test_paired_bootstrap_resamples_prompts_in_pairs():
    base = _records([100, 100, 100, 100], [1.0, 1.0, 1.0, 1.0], [0] * 4, [0] * 4)
    # Prompt 0 is 3x faster, the rest unchanged: every resample's ratio lies between the
    # per-prompt ratios (1 and 3), and the interval holds the overall one.
    faster = [{**r, "seconds": r["seconds"] / (3.0 if i == 0 else 1.0)} for i, r in enumerate(base)]
    low, high = harness.paired_bootstrap(faster, base, harness.throughput)
    assert 1.0 <= low < harness.throughput(faster) / harness.throughput(base) < high <= 3.0


def test_the_head_to_head_is_written_beside_the_table(tmp_path):
    results = _results()
    comparison = harness.compare(results, *harness.PAPER_COMPARISON)
    assert comparison["accept_length_ratio"] == pytest.approx(2.2 / 1.8)
    assert comparison["throughput_ratio"] == pytest.approx(1.2)
    assert comparison["throughput_ci"] == pytest.approx((1.2, 1.2))
    assert harness.compare({"marginal": results["marginal"]}, *harness.PAPER_COMPARISON) is None

    args = Namespace(out=tmp_path, target=Path("/t"), drafter=Path("/d"))
    table = harness.report(results, args)
    assert "conditional-16 over marginal" in table and "throughput 1.200x" in table
    saved = json.loads((tmp_path / "harness.json").read_text())
    assert saved["comparison"]["throughput_ratio"] == pytest.approx(1.2)
    assert saved["command"]["target"] == "/t"


def test_two_runs_compare_prompt_by_prompt_and_must_measure_the_same_prompts(
    tmp_path, monkeypatch, capsys
):
    import compare_runs

    results = _results()
    for run, method in (("after", "conditional-16"), ("before", "marginal")):
        (tmp_path / run).mkdir()
        records = {method: results[method], "no-spec": results["no-spec"]}
        (tmp_path / run / "harness.json").write_text(json.dumps({"records": records}))
    after, before = tmp_path / "after" / "harness.json", tmp_path / "before" / "harness.json"
    argv = ["compare_runs.py", str(after), "conditional-16", str(before), "marginal"]
    monkeypatch.setattr("sys.argv", argv)
    compare_runs.main()
    result = json.loads(capsys.readouterr().out)
    assert result["over"] == "before:marginal"
    assert result["throughput_ratio"] == pytest.approx(1.2)
    assert result["throughput_ci"] == pytest.approx([1.2, 1.2])
    shorter = {"marginal": {"code": results["marginal"]["code"][:2]}}
    before.write_text(json.dumps({"records": shorter}))
    with pytest.raises(SystemExit, match="same sets and prompts"):
        compare_runs.main()


def test_a_method_may_name_a_draft_vocabulary_candidates_leaves_nodes_and_temperature():
    assert harness.method_spec("conditional-4-v8192") == {
        **harness.METHODS["conditional-4"],
        "draft_vocab": 8192,
    }
    assert harness.method_spec("conditional-4-m16-v8192") == {
        **harness.METHODS["conditional-4"],
        "candidates": 16,
        "draft_vocab": 8192,
    }
    assert harness.method_spec("conditional-16-l4") == {
        **harness.METHODS["conditional-16"],
        "max_leaves": 4,
    }
    assert harness.method_spec("conditional-16-s0") == {
        **harness.METHODS["conditional-16"],
        "step_leaves": 0,
    }
    assert harness.method_spec("conditional-4-n8") == {
        **harness.METHODS["conditional-4"],
        "step_nodes": 8,
    }
    assert harness.method_spec("conditional-16-t1.4-v8192") == {
        **harness.METHODS["conditional-16"],
        "score_temperature": 1.4,
        "draft_vocab": 8192,
    }
    assert harness.method_spec("marginal-t1")["score_temperature"] == 1.0
    assert harness.known_method("conditional-16-v0") == "conditional-16-v0"
    for name in ("no-spec-v8192", "ngram-m16", "conditional-4-x16", "ngram-l2", "ngram-s0",
                 "ngram-t1.4", "ngram-n8", "conditional-4-v81.5",
                 "conditional-4-n1.5"):  # fmt: skip
        with pytest.raises(harness.argparse.ArgumentTypeError, match="unknown method"):
            harness.known_method(name)
