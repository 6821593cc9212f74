"""benchmarks/vocab_topk_bench.py on the CPU (small rows): every variant gives torch.topk's
values at indices that hold them, and its check sees a wrong answer. Timings are not
checked."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import vocab_topk_bench


def test_every_variant_gives_the_top(tmp_path, monkeypatch):
    argv = ["vocab_topk_bench.py", "--out", str(tmp_path), "--device", "cpu", "--batches", "1"]
    argv += ["--vocab", "3072", "--m", "8", "--chunk-sizes", "8", "16", "5", "128"]
    argv += ["--rounds", "2"]
    monkeypatch.setattr(sys, "argv", argv)
    vocab_topk_bench.main()
    rows = json.loads((tmp_path / "vocab_topk_bench.json").read_text())["rows"]
    # 5 does not divide 3072, and 3072 / 128 is under 4 x 8 chunks: not variants
    assert [r["variant"] for r in rows] == [
        "torch.topk",
        "chunk maxima, chunks of 8",
        "chunk maxima, chunks of 16",
    ]
    assert all(r["is_the_top"] for r in rows)


def test_the_check_sees_a_wrong_top():
    logits = torch.randn(3, 512).bfloat16()
    values, index = vocab_topk_bench.variants(512, 16, [8])["chunk maxima, chunks of 8"](logits, 16)
    assert vocab_topk_bench.is_the_top(logits, 16, values, index)
    wrong = index.clone()
    wrong[1, 3] = wrong[1, 4]  # a repeated index
    assert not vocab_topk_bench.is_the_top(logits, 16, values, wrong)
    assert not vocab_topk_bench.is_the_top(logits, 16, values.flip(-1), index.flip(-1))
