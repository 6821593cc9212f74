"""Tensor parallelism on CUDA (two GPUs: the `nvidia-h200-x2` kind; `scripts/gpu_jobs.sh
suite tp2`): every scorer at tensor_parallel_size=2 gives, in float32, the greedy
output of the target alone at TP=1.

At TP=2 the plugin drafts without its drafter graphs and prepares its trees outside the
builder's graph (both need one GPU); the target's verification still runs in vLLM's
graphs, and every rank must build the same trees (engine/rank_check.py stops an engine
whose ranks disagree). Splitting the target over two GPUs changes where its all-reduces
add, so the target alone at TP=2 is checked against TP=1 first: the comparison the issue
asks for (TP=1 without speculation) only means something if plain TP=2 decoding already
equals it on these prompts."""

from __future__ import annotations

import pytest
import torch

from vllm_dominotree.demo.toy_pair import PairSpec, write_pair

from .sharing import PROMPTS, engine_memory, run_engine

if torch.cuda.device_count() < 2:
    pytest.skip("needs two GPUs (tensor_parallel_size=2)", allow_module_level=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return write_pair(tmp_path_factory.mktemp("tp-pair"), PairSpec(noise=0.8, context=1.4))


def generate(dirs, speculative_config, tensor_parallel_size: int) -> tuple:
    from vllm import SamplingParams

    return run_engine(
        str(dirs[0]),
        PROMPTS,
        SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
        speculative_config,
        dtype="float32",
        max_model_len=512,
        max_num_seqs=16,
        tensor_parallel_size=tensor_parallel_size,
        **engine_memory(kv_gib=1),
    )


@pytest.fixture(scope="module")
def tp1_alone(dirs) -> list[list[int]]:
    return generate(dirs, None, 1)[0]


def test_the_target_alone_at_tp2_equals_tp1(dirs, tp1_alone):
    assert generate(dirs, None, 2)[0] == tp1_alone


@pytest.mark.parametrize("scorer", ["conditional", "marginal", "chain"])
def test_greedy_at_tp2_equals_the_target_alone_at_tp1(dirs, tp1_alone, scorer):
    config = {"method": "dominotree", "model": str(dirs[1]), "scorer": scorer}
    tokens, stats = generate(dirs, config, 2)
    print(scorer, stats)
    assert tokens == tp1_alone
    assert stats["trees"] > 0 and stats["accepted_tokens"] > 0
    # Under tensor parallelism the drafter's query pass runs vLLM's piecewise pass and
    # the scorer is prepared outside the builder's graph: counted, not hidden.
    assert stats["eager_drafts"] > 0 and stats["graph_drafts"] == 0
    assert stats["prepared_in_build"] == 0
    if scorer == "chain":
        assert stats["sibling_accepts"] == 0 and stats["mean_leaves"] == 1
    else:
        assert stats["sibling_accepts"] > 0 and stats["mean_leaves"] > 2
