"""Tensor parallelism (TP=2 on this 2-core CPU, one core per rank): every rank builds the
same trees and accepts the same paths, so the output is the target's own and the
acceptance is TP=1's, step for step; a rank that drafts something else stops the engine
with a message (engine/rank_check.py)."""

from __future__ import annotations

import contextlib
import os
import sys

import cloudpickle
import pytest

from vllm_dominotree.tree.ancestry import TOKEN

from .conftest import PROMPTS, assert_sampled_law, dominotree, greedy, make_llm, shutdown

COUNTERS = ("steps", "trees", "accepted_tokens", "sibling_accepts", "kv_moves", "tree_leaves")


@contextlib.contextmanager
def environment(**values):
    """Variables the engine's processes inherit when they start (set only meanwhile)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def make_tp2(pair_dirs, config, **env):
    with environment(VLLM_CPU_OMP_THREADS_BIND="0|1", **env):
        return make_llm(pair_dirs, config, tensor_parallel_size=2)


def seeded(llm) -> list[list[int]]:
    from vllm import SamplingParams

    params = [
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=s, ignore_eos=True)
        for s in range(len(PROMPTS))
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def run(llm) -> dict:
    """Greedy tokens with every rank's counters for them, then seeded samples."""
    tokens = greedy(llm)
    stats = llm.collective_rpc("dominotree_stats")
    return {
        "greedy": tokens,
        "stats": [{k: s[k] for k in COUNTERS} for s in stats],
        "seeded": seeded(llm),
    }


@pytest.fixture(scope="module")
def expected(baseline):
    return greedy(baseline)


@pytest.fixture(scope="module", params=["conditional", "marginal", "chain"])
def tp_runs(request, pair_dirs):
    """(scorer, the TP=1 plugin's run, the TP=2 engine and its run), one engine at a time.
    Without step_leaves: its share of leaves follows how the scheduler batches requests,
    which may differ between the two engines, and their trees are compared."""
    config = dominotree(pair_dirs, scorer=request.param, step_leaves=0)
    tp1 = make_llm(pair_dirs, config)
    try:
        one = run(tp1)
    finally:
        shutdown(tp1)
    tp2 = make_tp2(pair_dirs, config)
    try:
        yield request.param, one, tp2, run(tp2)
    finally:
        shutdown(tp2)


def test_tp2_is_lossless_and_builds_tp1s_trees(tp_runs, expected):
    scorer, one, _, two = tp_runs
    assert two["greedy"] == one["greedy"] == expected
    # Both ranks counted the same trees and paths, and so did the TP=1 engine (in as
    # many steps or not: how requests share steps is the scheduler's business).
    assert two["stats"][0] == two["stats"][1]
    per_tree = [k for k in COUNTERS if k != "steps"]
    assert {k: two["stats"][0][k] for k in per_tree} == {k: one["stats"][0][k] for k in per_tree}
    stats = two["stats"][0]
    assert stats["trees"] > 0 and stats["accepted_tokens"] > 0
    if scorer != "chain":
        assert stats["sibling_accepts"] > 0  # accepted non-first children: real trees


def test_tp2_seeded_sampling_reproduces_and_matches_tp1(tp_runs):
    _, one, tp2, two = tp_runs
    assert seeded(tp2) == two["seeded"] == one["seeded"]
    assert len({tuple(t) for t in two["seeded"]}) > 1


def test_tp2_samples_follow_the_target_distribution(tp_runs, pair_dirs):
    scorer, _, tp2, _ = tp_runs
    if scorer != "conditional":
        pytest.skip("one scorer is enough for the law (TP=1 checks the sampler itself)")
    assert_sampled_law(tp2, pair_dirs["target"], requests=400)


def _draft_differently_on_rank_1(worker) -> None:
    """Run inside each worker: rank 1's proposer changes the last token of its first tree
    where the next step reads it (the builder's table)."""
    if worker.rank != 1:
        return
    drafter = worker.model_runner.drafter
    propose = drafter.propose

    def perturbed(*args, **kwargs):
        drafts = propose(*args, **kwargs)
        tokens = drafter.builder.table[TOKEN, 0, : drafter.builder.slots]
        tokens[-1] = (tokens[-1] + 1) % 63
        return drafts

    drafter.propose = perturbed


def test_a_rank_that_drafts_another_tree_stops_the_engine(pair_dirs, capfd):
    """The workers log the error (their output is this process's); the caller sees the
    engine die instead of getting tokens."""
    # Both sides of the RPC must accept a pickled function (test-only).
    insecure = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    with environment(**insecure):
        llm = make_tp2(pair_dirs, dominotree(pair_dirs))
    try:
        with environment(**insecure):
            cloudpickle.register_pickle_by_value(sys.modules[__name__])
            llm.collective_rpc(_draft_differently_on_rank_1)
        with pytest.raises(Exception, match="EngineCore"):
            greedy(llm, prompts=PROMPTS[:2], max_tokens=16)
        logged = "".join(capfd.readouterr())
        assert "tensor-parallel ranks built different draft trees" in logged
        assert "ranks [1] differ from rank 0" in logged
    finally:
        shutdown(llm)


def test_tp2_server_serves_the_targets_tokens(pair_dirs, baseline, tmp_path):
    """`--tensor-parallel-size 2` through vLLM's OpenAI server: completions of token-id
    prompts, plain and streamed, equal the offline TP=1 engine without speculation."""
    import json

    import requests

    from vllm_dominotree.evaluation.server import ApiServer, ServerError, sse_events

    spec = {"method": "dominotree", "model": pair_dirs["drafter"]}
    args = [
        "--served-model-name",
        "toy",
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--enforce-eager",
        "--seed",
        "0",
        "--tensor-parallel-size",
        "2",
        "--speculative-config",
        json.dumps(spec),
    ]
    server = ApiServer.start(
        pair_dirs["target"],
        tmp_path / "server.log",
        args,
        env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    )
    try:
        try:
            server.wait_healthy(240)
        except ServerError as err:
            pytest.fail(str(err))
        want = greedy(baseline, PROMPTS[:4], max_tokens=32)
        for prompt, tokens in zip(PROMPTS[:4], want, strict=True):
            body = {
                "model": "toy",
                "prompt": prompt,
                "max_tokens": 32,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            plain = requests.post(f"{server.url}/v1/completions", json=body, timeout=120)
            assert plain.status_code == 200, plain.text
            assert plain.json()["choices"][0]["token_ids"] == tokens
            streamed = requests.post(
                f"{server.url}/v1/completions",
                json=body | {"stream": True},
                stream=True,
                timeout=120,
            )
            got = [
                t
                for e in sse_events(streamed.iter_lines(decode_unicode=True))
                for t in e["choices"][0].get("token_ids") or []
            ]
            assert got == tokens
        metrics = requests.get(f"{server.url}/metrics", timeout=30).text
        assert "vllm:spec_decode_num_accepted_tokens_total" in metrics
        assert server.alive()
    finally:
        server.stop()
