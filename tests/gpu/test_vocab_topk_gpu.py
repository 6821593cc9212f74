"""The vocabulary's top M on the GPU (kernels/vocab_topk.py, DOMINOTREE_VOCAB_TOPK=triton):
the stable sort's top (larger first, equal values by smaller index) over Qwen3's
vocabulary at the batches the scorers prepare (requests x 16 rows), bf16 and float32;
and the same values as torch.topk."""

from __future__ import annotations

import pytest
import torch

from vllm_dominotree.kernels.vocab_topk import vocab_topk


@pytest.mark.parametrize("rows", [16, 256, 1024])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [64, 128])
def test_top_m_is_the_stable_sorts_top(rows, dtype, m):
    gen = torch.Generator(device="cuda").manual_seed(rows + m)
    x = torch.randn(rows, 151936, generator=gen, device="cuda").to(dtype)
    x[:, 1000:1100] = x[:, 7:8]  # equal values
    x[0, -300:] = 40.0  # more equal best values than fit
    values, index = vocab_topk(x, m)
    order = torch.argsort(-x.float(), dim=-1, stable=True)[:, :m]
    assert torch.equal(index, order)
    assert torch.equal(values, torch.gather(x, -1, order))
    assert torch.equal(values, x.topk(m, -1).values)
