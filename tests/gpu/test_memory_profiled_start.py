"""A tree engine started as `vllm serve` starts one: its KV cache sized by vLLM's memory
profiler. Every other GPU test gives its engine a fixed KV cache (sharing.py) so that
test processes can share the GPU, and vLLM then skips the profiler: its dummy forward and
the CUDA graph memory estimate (profile_cudagraph_memory), whose warm-up forwards run
with the plugin's capture flag set and no trees. There the path pass indexed an empty
FA3 output (H100, 2026-12-06f: every conditional engine of round_cost_bench failed to
start). scripts/gpu_jobs.sh runs this file alone on the GPU, after `suite tests`."""

from __future__ import annotations

import pytest

from vllm_dominotree.demo.toy_pair import PairSpec, write_pair

from .sharing import run_engine


@pytest.mark.parametrize("model_runner", ["v1", "v2"])
def test_a_bf16_tree_engine_starts_under_vllms_memory_profiler(tmp_path, model_runner):
    from vllm import SamplingParams

    target, drafter = write_pair(tmp_path, PairSpec(noise=0.8, context=1.4))
    config = {"method": "dominotree", "model": str(drafter), "model_runner": model_runner}
    prompts = [[5, 9, 12, 3], list(range(10, 30)), [7] * 27]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    tokens, stats = run_engine(
        str(target),
        prompts,
        params,
        config,
        dtype="bfloat16",  # FA3, so the trees go through the path pass
        max_model_len=512,
        max_num_seqs=4,
        gpu_memory_utilization=0.3,  # no kv_cache_memory_bytes: the profiler sizes it
    )
    print(model_runner, stats)
    assert [len(t) for t in tokens] == [32] * len(prompts)
    assert stats["tree_attention"] == "one-pass"  # bf16 with FA3: CUDA's default
    assert stats["trees"] > 0 and stats["mean_accept_length"] > 1.0
