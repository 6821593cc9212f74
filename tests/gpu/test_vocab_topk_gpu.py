"""tree/scorers.vocab_topk on CUDA: the chunk maxima's path (taken by default from 256 rows)
gives a stable descending sort's first k, values and indices, on every call alike, in
bf16 and float32, also inside a CUDA graph (the builder's prepare records it there);
below 256 rows it is torch.topk."""

from __future__ import annotations

import pytest
import torch

from vllm_dominotree.tree.scorers import TOPK_CHUNKED_ROWS, vocab_topk

VOCAB = 151936  # Qwen3's: 1187 chunks of 128


def stable_top(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ordered = logits.cpu().float().sort(dim=-1, descending=True, stable=True)
    return ordered.values[..., :k], ordered.indices[..., :k]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_default_path_is_a_stable_sorts_top_every_call(dtype):
    gen = torch.Generator().manual_seed(0)
    # Coarse values: ties across the k-th value in every row.
    logits = (torch.randn(16, 16, VOCAB, generator=gen) * 4).round().to(dtype).cuda()
    assert logits.shape[0] * logits.shape[1] >= TOPK_CHUNKED_ROWS
    values, index = vocab_topk(logits, 64)
    want_values, want_index = stable_top(logits, 64)
    assert torch.equal(values.cpu().float(), want_values)
    assert torch.equal(index.cpu(), want_index)
    for _ in range(3):
        again = vocab_topk(logits, 64)
        assert torch.equal(again[0], values) and torch.equal(again[1], index)


def test_inside_a_cuda_graph():
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(256, VOCAB, generator=gen) * 3).bfloat16().cuda()
    vocab_topk(logits, 64)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        values, index = vocab_topk(logits, 64)
    logits.copy_((torch.randn(256, VOCAB, generator=gen) * 3).bfloat16())
    graph.replay()
    want_values, want_index = stable_top(logits, 64)
    assert torch.equal(values.cpu().float(), want_values)
    assert torch.equal(index.cpu(), want_index)


def test_few_rows_take_torch_topk():
    logits = torch.randn(16, VOCAB, device="cuda").bfloat16()
    values, index = vocab_topk(logits, 64)
    want = logits.topk(64, dim=-1)
    assert torch.equal(values, want.values) and torch.equal(index, want.indices)
