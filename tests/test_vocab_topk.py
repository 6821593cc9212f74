"""tree/scorers.vocab_topk: the top k through the chunks' maxima (CUDA's path, forced here
on the CPU) gives a stable descending sort's first k, values and indices (torch.topk's
values, equal values in index order), also where the top values crowd one chunk, spread
one to a chunk, or tie; and the same on every call."""

from __future__ import annotations

import pytest
import torch

from vllm_dominotree.tree.scorers import vocab_topk


def assert_is_the_top(logits: torch.Tensor, k: int, values: torch.Tensor, index: torch.Tensor):
    want = logits.sort(dim=-1, descending=True, stable=True)
    assert torch.equal(values, want.values[..., :k])
    assert torch.equal(index, want.indices[..., :k])
    assert torch.equal(values, logits.topk(k, dim=-1).values)


def chunked(logits: torch.Tensor, k: int, chunk: int = 16):
    return vocab_topk(logits, k, chunked=True, chunk=chunk)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_random_rows_of_several_leading_dimensions(dtype):
    logits = (3 * torch.randn(2, 3, 4096, generator=torch.Generator().manual_seed(0))).to(dtype)
    values, index = chunked(logits, 8)
    assert values.shape == index.shape == (2, 3, 8)
    assert_is_the_top(logits, 8, values, index)


def test_the_top_one_to_a_chunk_and_all_in_one_chunk():
    """One to a chunk, every one of the k best chunks is needed (k - 1 chunks would miss
    a value); all in one chunk, one chunk holds them and the others hold none."""
    k, chunk, width = 8, 16, 1024
    spread = torch.zeros(2, width)
    spread[0, torch.arange(k) * chunk * 3 + 5] = torch.arange(1.0, k + 1)
    spread[1, 7 * chunk : 7 * chunk + k] = torch.arange(1.0, k + 1)
    values, index = chunked(spread, k, chunk)
    assert_is_the_top(spread, k, values, index)
    assert values[0].tolist() == list(range(k, 0, -1))


def test_ties_and_masked_tokens():
    """Few distinct values (ties everywhere, also across the k-th value) and rows with
    fewer than k finite logits (the rest -inf, as masked tokens)."""
    gen = torch.Generator().manual_seed(1)
    ties = torch.randint(0, 4, (4, 2048), generator=gen).float()
    assert_is_the_top(ties, 16, *chunked(ties, 16))
    signed_zeros = torch.zeros(1, 2048)
    signed_zeros[0, ::3] = -0.0
    assert_is_the_top(signed_zeros, 8, *chunked(signed_zeros, 8))
    masked = torch.full((2, 2048), float("-inf"))
    masked[0, [3, 900, 2047]] = torch.tensor([1.0, 2.0, 0.5])
    values, index = chunked(masked, 8)
    assert_is_the_top(masked, 8, values, index)
    assert values[0, :3].tolist() == [2.0, 1.0, 0.5] and index[0, :3].tolist() == [900, 3, 2047]


@pytest.mark.parametrize("width", [4096 + 8, 16 * 16 * 4 - 16])
def test_rows_it_does_not_chunk_are_torch_topk(width):
    """A width that is not a multiple of the chunk, or under 4 k chunks: torch.topk."""
    logits = torch.randn(3, width, generator=torch.Generator().manual_seed(2))
    values, index = chunked(logits, 16)
    want = logits.topk(16, dim=-1)
    assert torch.equal(values, want.values) and torch.equal(index, want.indices)


def test_the_cpu_takes_torch_topk_unless_asked():
    logits = torch.randn(2, 4096, generator=torch.Generator().manual_seed(3))
    values, index = vocab_topk(logits, 8, chunk=16)
    want = logits.topk(8, dim=-1)
    assert torch.equal(values, want.values) and torch.equal(index, want.indices)
