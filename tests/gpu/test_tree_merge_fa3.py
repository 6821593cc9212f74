"""The merged tree attention on the GPU (DOMINOTREE_CUDA_TREE_ATTENTION=one-pass-merge):
FA3 over each request's prefix, the Triton tree part and the merge give the dense
reference's ancestor-only attention for every row, in bf16 as close as the path requests
(the one-pass default) are; how many elements differ between the two is printed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from path_checks import merged_case, merged_inputs
from tree_attention_check import bf16_case, paths_output

from vllm_dominotree.engine.cuda_attention import attend_merged
from vllm_dominotree.kernels.tree_attention import tree_attention_reference


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("shape", ["qwen3-4b", "smollm2-135m"])
def test_merged_rows_match_the_reference_as_closely_as_paths(seed, shape):
    contexts = [0, 5, 700, 1500] if seed == 0 else None  # an empty prefix weighs nothing
    case = bf16_case(shape, seed, context=1100, contexts=contexts)
    head_dim = case[0].shape[-1]
    want = torch.zeros(case[0].shape, device="cuda")
    every = torch.ones_like(case[-1])
    tree_attention_reference(case[0].float(), *case[1:-1], every, head_dim**-0.5, want)
    got = merged_case(case, varlen=_fa3())
    paths = paths_output(case, each_row=False, every_row=True)
    merged_error = (got.float() - want).abs().max().item()
    paths_error = (paths.float() - want).abs().max().item()
    differ = (got != paths).float().mean().item()
    print(
        f"seed {seed} shape {shape}: max error merged {merged_error:.2e}, paths "
        f"{paths_error:.2e}; {100 * differ:.2f}% of elements differ"
    )
    assert paths_error < 3e-2  # the comparison's other side is itself right
    assert merged_error < 3e-2
    assert merged_error <= 2 * paths_error + 4e-3


def test_merged_rows_in_a_cuda_graph_follow_the_replayed_inputs():
    """Captured once, replayed after another batch of the same shape (new K/V, queries
    and shorter prefixes) is written into the captured inputs: the rows follow it."""
    first = bf16_case("qwen3-4b", 5, context=1100)
    second = list(bf16_case("qwen3-4b", 5, context=1100))
    for i in range(3):  # query, key_cache, value_cache: new values
        second[i] = torch.randn_like(second[i])
    second[5] = second[5] - (second[5] - (second[4][1:] - second[4][:-1]) >= 3).int() * 3
    inputs, fresh = merged_inputs(first), merged_inputs(second)
    attend_merged(**inputs)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attend_merged(**inputs)
    for name, value in fresh.items():
        if isinstance(value, torch.Tensor) and name != "rows":
            inputs[name].copy_(value)
    graph.replay()
    attend_merged(**fresh)
    assert not torch.equal(fresh["rows"], merged_case(first, varlen=_fa3()))
    assert torch.equal(inputs["rows"], fresh["rows"])


def _fa3():
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func

    return flash_attn_varlen_func
