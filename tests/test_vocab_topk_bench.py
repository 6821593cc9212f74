"""benchmarks/vocab_topk_bench.py on the CPU (small rows): every variant gives torch.topk's
values at indices that hold them, and its check sees a wrong answer; the chunk maxima's
top k with keys without ties is a stable descending sort's first k, also where the top
values crowd one chunk, spread one to a chunk, or tie. Timings are not checked."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import vocab_topk_bench
from vocab_topk_bench import chunk_maxima_topk


def test_every_variant_gives_the_top(tmp_path, monkeypatch):
    argv = ["vocab_topk_bench.py", "--out", str(tmp_path), "--device", "cpu", "--batches", "1"]
    argv += ["--vocab", "3072", "--m", "8", "--chunk-sizes", "8", "5", "128", "--rounds", "2"]
    monkeypatch.setattr(sys, "argv", argv)
    vocab_topk_bench.main()
    rows = json.loads((tmp_path / "vocab_topk_bench.json").read_text())["rows"]
    # 5 does not divide 3072, and 3072 / 128 is under 4 x 8 chunks: not variants
    assert [r["variant"] for r in rows] == [
        "torch.topk",
        "chunk maxima, chunks of 8",
        "chunk maxima, chunks of 8, chunks' keys without ties",
        "chunk maxima, chunks of 8, keys without ties",
    ]
    assert all(r["is_the_top"] and r["same_every_call"] for r in rows)


def test_the_check_sees_a_wrong_top():
    logits = torch.randn(3, 512).bfloat16()
    values, index = chunk_maxima_topk(logits, 16, 8)
    assert vocab_topk_bench.is_the_top(logits, 16, values, index)
    wrong = index.clone()
    wrong[1, 3] = wrong[1, 4]  # a repeated index
    assert not vocab_topk_bench.is_the_top(logits, 16, values, wrong)
    assert not vocab_topk_bench.is_the_top(logits, 16, values.flip(-1), index.flip(-1))
    fn = vocab_topk_bench.variants(512, 16, [8])["chunk maxima, chunks of 8"]
    assert vocab_topk_bench.same_every_call(fn, logits, 16, index, None)
    assert vocab_topk_bench.same_every_call(fn, logits, 16, index, index.clone())
    assert not vocab_topk_bench.same_every_call(fn, logits, 16, index, wrong)  # graph's other


def assert_stable_top(logits: torch.Tensor, k: int, chunk: int = 16):
    values, index = chunk_maxima_topk(logits, k, chunk, ("chunks", "logits"))
    want = logits.sort(dim=-1, descending=True, stable=True)
    assert torch.equal(values, want.values[..., :k])
    assert torch.equal(index, want.indices[..., :k])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_keys_without_ties_give_a_stable_sorts_top(dtype):
    gen = torch.Generator().manual_seed(0)
    assert_stable_top((3 * torch.randn(6, 4096, generator=gen)).to(dtype), 8)
    ties = torch.randint(0, 4, (4, 2048), generator=gen).to(dtype)  # ties across the k-th
    assert_stable_top(ties, 16)
    signed_zeros = torch.zeros(1, 2048, dtype=dtype)
    signed_zeros[0, ::3] = -0.0
    assert_stable_top(signed_zeros, 8)


def test_the_top_one_to_a_chunk_all_in_one_chunk_and_masked():
    """One to a chunk, every one of the k best chunks is needed (k - 1 chunks would miss
    a value); all in one chunk, one chunk holds them; fewer than k finite logits."""
    k, chunk = 8, 16
    logits = torch.zeros(3, 1024)
    logits[0, torch.arange(k) * chunk * 3 + 5] = torch.arange(1.0, k + 1)
    logits[1, 7 * chunk : 7 * chunk + k] = torch.arange(1.0, k + 1)
    logits[2] = float("-inf")
    logits[2, [3, 900, 1023]] = torch.tensor([1.0, 2.0, 0.5])
    assert_stable_top(logits, k, chunk)
    for tie_free in vocab_topk_bench.TIE_FREE.values():
        values, _ = chunk_maxima_topk(logits, k, chunk, tie_free)
        assert torch.equal(values, logits.topk(k, dim=-1).values)
