"""DominoTree in a real vLLM engine on CUDA: greedy output equals the engine without
speculation (float32 toy pair whose target depends on its context)."""

from __future__ import annotations

import gc

import pytest

from vllm_dominotree.toy_pair import PairSpec, write_pair

PROMPTS = [[5], [40, 41], [5, 9, 12, 3], list(range(10, 30)), [i % 60 for i in range(3, 120, 3)],
           [7] * 27, [1, 2, 3, 4, 5, 6, 7], [30, 31, 32, 33, 34, 35]]  # fmt: skip


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return write_pair(tmp_path_factory.mktemp("gpu-pair"), PairSpec(noise=0.8, context=1.4))


def generate(dirs, speculative_config, **kwargs):
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(dirs[0]),
        dtype="float32",
        max_model_len=512,
        seed=0,
        gpu_memory_utilization=0.3,
        speculative_config=speculative_config,
        **kwargs,
    )
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    stats = llm.collective_rpc("dominotree_stats")[0] if speculative_config else None
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return tokens, stats


@pytest.fixture(scope="module")
def expected(dirs):
    return generate(dirs, None, enforce_eager=True)[0]


@pytest.mark.parametrize("scorer", ["conditional", "marginal"])
def test_greedy_equals_no_speculation(dirs, expected, scorer):
    config = {"method": "dominotree", "model": str(dirs[1]), "scorer": scorer}
    tokens, stats = generate(dirs, config, enforce_eager=True)
    assert tokens == expected
    assert stats["trees"] > 0 and stats["kv_moves"] > 0
    print(scorer, stats)


def test_greedy_with_piecewise_cuda_graphs(dirs, expected):
    config = {"method": "dominotree", "model": str(dirs[1])}
    tokens, stats = generate(dirs, config)
    assert tokens == expected
    assert stats["trees"] > 0 and stats["sibling_accepts"] > 0
    print("graphs", stats)
