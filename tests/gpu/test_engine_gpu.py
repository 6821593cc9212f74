"""DominoTree in a real vLLM engine on CUDA: greedy output equals the engine without
speculation (float32 toy pair whose target depends on its context), with the target's
verification inside vLLM's FULL CUDA graphs, through piecewise graphs in mixed
prefill/decode batches, and eagerly."""

from __future__ import annotations

import collections
import functools
import shutil
import sys
from pathlib import Path

import pytest

from vllm_dominotree.demo.toy_pair import PairSpec, write_pair
from vllm_dominotree.drafter.draft_vocab import write_ranking

from .sharing import PROMPTS, engine_memory, run_engine

# Long prompts beside short ones, with a small token budget per step: prefill chunks
# share steps with other requests' trees (mixed batches run piecewise).
MIXED = [*PROMPTS, [(7 * i) % 61 for i in range(150)], [(3 * i + 1) % 59 for i in range(200)]]


# How far apart float32 verification rows and decoding's round on CUDA (their GEMMs take
# 17 rows a request against one, and the K/V each writes feeds the later tokens): leads
# up to 5.5e-4 nat apart on the H100 and 3.0e-3 on the H200 (2026-12-06, 2 of 64 tokens
# of one prompt past 1e-3, late in it: 3.4579 against 3.4548, 0.0802 against 0.0791;
# every token and runner-up equal; test_logprobs_under_full_graphs_equal_no_speculation).
# A row read from the wrong place is off by far more. A greedy choice whose lead is
# below this may go either way, with speculation or without.
FLOAT32_ROUNDING = 5e-3


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return write_pair(tmp_path_factory.mktemp("gpu-pair"), PairSpec(noise=0.8, context=1.4))


def generate(dirs, speculative_config, prompts=PROMPTS, params=None, **kwargs):
    from vllm import SamplingParams

    params = params or SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    return run_engine(
        str(dirs[0]),
        prompts,
        params,
        speculative_config,
        dtype="float32",
        max_model_len=512,
        **engine_memory(kv_gib=1),
        **{"max_num_seqs": 16, **kwargs},
    )


@pytest.fixture(scope="module")
def expected(dirs):
    return generate(dirs, None, prompts=MIXED, enforce_eager=True)[0]


@pytest.fixture(scope="module")
def default_runs(dirs):
    """scorer -> (tokens, stats) of PROMPTS under the engine's defaults, each run once
    per test process (the drafts test below reuses the conditional one)."""
    runs = {}

    def run(scorer: str):
        if scorer not in runs:
            config = {"method": "dominotree", "model": str(dirs[1]), "scorer": scorer}
            runs[scorer] = generate(dirs, config)
        return runs[scorer]

    return run


@pytest.mark.parametrize("scorer", ["conditional", "marginal", "chain"])
def test_greedy_equals_no_speculation_under_full_graphs(default_runs, expected, scorer):
    tokens, stats = default_runs(scorer)
    print(scorer, stats)
    assert tokens == expected[: len(PROMPTS)]
    assert stats["trees"] > 0
    # float32 runs vLLM's Triton backend: the default tree attention ("auto") is the fix-up,
    # under the stock pass.
    assert stats["tree_attention"] == "fixup"
    assert stats["one_pass_steps"] == stats["one_pass_graphs"] == 0
    # vLLM's default for DFlash on CUDA, kept: the next step is prepared while this runs.
    assert stats["async_scheduling"] is True
    # Decode steps are uniform batches: vLLM replays one FULL graph for them.
    assert stats["full_graph_steps"] > 0.8 * stats["steps"]
    # Every tree came out of the builder's captured graphs (one per padded batch size).
    assert stats["graph_builds"] >= stats["steps"] and stats["eager_builds"] == 0
    # One GPU, small vocabulary: every build began with the drafter's logits and the
    # scorer's preparation, inside its graph.
    assert stats["prepared_in_build"] == stats["graph_builds"]
    # Greedy: every step's acceptance and K/V move replayed the accept graphs, with the
    # fused acceptance kernel (CUDA's default).
    assert stats["graph_accepts"] >= stats["steps"] and stats["eager_accepts"] == 0
    assert stats["accept_kernel"] == "triton"
    # Every step's trees reached its description by one replay of the captured gather.
    assert stats["graph_descriptions"] == stats["steps"] and stats["eager_descriptions"] == 0
    # Every drafting step (prefill steps too) ran the query pass as one graph replay.
    assert stats["graph_drafts"] >= stats["steps"] and stats["eager_drafts"] == 0
    if scorer == "chain":
        assert stats["sibling_accepts"] == 0 and stats["mean_leaves"] == 1
    else:
        assert stats["sibling_accepts"] > 0 and stats["kv_moves"] > 0
        assert stats["mean_leaves"] > 2


def test_logprobs_under_full_graphs_equal_no_speculation(dirs):
    """logprobs=2 with the trees accepted in the accept graphs: each token's lead over
    its runner-up (and the runner-up) as the engine without speculation reports them,
    drafted tokens and bonuses alike (engine/acceptance.py accepted_logprobs)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=2)
    want_tokens, _, want = generate(dirs, None, params=params, margins=True)
    config = {"method": "dominotree", "model": str(dirs[1])}
    tokens, stats, got = generate(dirs, config, params=params, margins=True)
    assert tokens == want_tokens
    assert stats["graph_accepts"] >= stats["steps"] > 0 and stats["sibling_accepts"] > 0
    for ours, theirs in zip(got, want, strict=True):
        assert [runner_up for _, runner_up in ours] == [runner_up for _, runner_up in theirs]
        leads = pytest.approx([lead for lead, _ in theirs], abs=FLOAT32_ROUNDING)
        assert [lead for lead, _ in ours] == leads


def test_sampling_constraints_equal_no_speculation(dirs):
    """Penalties and allowed tokens (engine/sampling_constraints.py): the
    steps accept eagerly (the accept graphs hold the plain argmax), each tree row
    constrained for its own path; greedy output is the target's own under the same."""
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0,
        max_tokens=64,
        ignore_eos=True,
        repetition_penalty=3.0,
        presence_penalty=1.0,
        allowed_token_ids=list(range(0, 64, 2)),
    )
    want, _ = generate(dirs, None, params=params)
    assert want != generate(dirs, None)[0]  # the penalties move the output
    tokens, stats = generate(dirs, {"method": "dominotree", "model": str(dirs[1])}, params=params)
    assert stats["eager_accepts"] >= stats["steps"] > 0 and stats["graph_accepts"] == 0
    # Equal, or apart from a near-tie on: penalties pull repeated tokens together (on the
    # H100, 2026-12-06, one prompt parted at a lead of 1.7e-4 nat between two penalized
    # tokens). The CPU test (tests/engine/test_sampling_constraints.py) asks for equality.
    parted = 0
    for prompt, ours, theirs in zip(PROMPTS, tokens, want, strict=True):
        if ours == theirs:
            continue
        first = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
        lead, runner_up = penalized_lead(dirs[0], prompt, theirs[:first], params)
        print(f"prompt {prompt[:4]}: parted at {first}, the target's lead {lead:.1e} nat")
        assert lead < FLOAT32_ROUNDING and ours[first] == runner_up, (prompt, first, lead)
        parted += 1
    assert parted <= len(PROMPTS) // 4


@functools.cache
def float32_model(target: Path):
    """The target in transformers, float32 on the CPU (loaded once per test process)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()


def penalized_lead(target: Path, prompt: list[int], output: list[int], params) -> tuple[float, int]:
    """The target's lead (its best logit over the runner-up) and runner-up for the token
    after prompt + output, under params' repetition and presence penalties and allowed
    tokens as vLLM applies them (transformers, float64 over float32 logits, on the CPU)."""
    import torch

    model = float32_model(target)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, -1].double()
    for token in set(prompt + output):  # vLLM's repetition penalty: prompt and output
        penalty = params.repetition_penalty
        logits[token] = logits[token] / penalty if logits[token] > 0 else logits[token] * penalty
    for token in set(output):
        logits[token] -= params.presence_penalty
    allowed = torch.zeros_like(logits, dtype=torch.bool)
    allowed[params.allowed_token_ids] = True
    values, tokens = logits.masked_fill(~allowed, float("-inf")).topk(2)
    return float(values[0] - values[1]), int(tokens[1])


@pytest.mark.parametrize("candidates", [64, 16])
def test_chain_on_the_v2_runner_equals_no_speculation(dirs, expected, candidates):
    """The chain on vLLM's V2 runner (model_runner "v2"): vLLM's DFlash speculator
    drafting Domino's chain inside its FULL graph, vLLM's own verification; over the toy
    pair's whole vocabulary of 64 (the torch step) and over 16 candidates (the Triton
    step, CUDA's default for a top-M restriction)."""
    config = {
        "method": "dominotree",
        "model": str(dirs[1]),
        "scorer": "chain",
        "candidates": candidates,
        "model_runner": "v2",
    }
    tokens, counters = generate(dirs, config)
    print(f"chain-v2-m{candidates}", counters)
    assert tokens == expected[: len(PROMPTS)]
    assert counters["vllm:spec_decode_num_accepted_tokens"] > 0
    assert counters["candidates"] == candidates
    assert counters["scorer_step"] == ("triton" if candidates < 64 else "torch")


@pytest.mark.parametrize("scorer", ["conditional", "marginal"])
def test_trees_on_the_v2_runner_equal_no_speculation(dirs, expected, scorer):
    """Trees on vLLM's V2 runner (model_runner "v2"): the device builder in DFlash's FULL
    graph, the tree kernel in the target's, tree acceptance in the accept graphs."""
    config = {"method": "dominotree", "model": str(dirs[1]), "scorer": scorer, "model_runner": "v2"}
    tokens, stats = generate(dirs, config)
    print(f"{scorer}-v2", stats)
    assert tokens == expected[: len(PROMPTS)]
    assert stats["vllm:spec_decode_num_accepted_tokens"] > 0
    # float32 runs vLLM's Triton backend: the fix-up kernel (path requests need FA3), under
    # the stock pass (one pass would skip the Triton call that writes the KV cache).
    assert stats["model_runner"] == "v2" and stats["tree_attention"] == "fixup"
    assert stats["one_pass_steps"] == stats["one_pass_graphs"] == 0
    # The runner's counters against vLLM's: under asynchronous scheduling a request that
    # finished was scheduled once more, its tree verified and counted here while vLLM
    # drops its tokens (and counts no draft): at most one such tree per request (on V1
    # the same engine counts the same trees and tokens as V2, 2026-12-04f).
    assert 0 <= stats["trees"] - stats["vllm:spec_decode_num_drafts"] <= len(PROMPTS)
    assert stats["accepted_tokens"] >= stats["vllm:spec_decode_num_accepted_tokens"]
    # Trees branch, and accepted paths move.
    assert stats["sibling_accepts"] > 0 and stats["kv_moves"] > 0
    # Greedy steps accept through the accept graphs (accept_graphs.py), with the fused
    # acceptance kernel (CUDA's default).
    assert stats["graph_accepts"] == stats["steps"] > 0 and stats["eager_accepts"] == 0
    assert stats["accept_kernel"] == "triton"
    # Every build inside DFlash's FULL graphs: none by the host outside them; every
    # step described by the gather's graph.
    assert stats["graph_builds"] == stats["eager_builds"] == 0
    assert stats["graph_descriptions"] >= stats["steps"] and stats["eager_descriptions"] == 0


def test_trees_past_vllms_capture_sizes_build_in_the_builders_graph(dirs, expected):
    """V2 with vLLM's graphs capped at 8 tokens: the target's forwards run eagerly (17
    rows a request) and so do the drafts vLLM's speculator has no graph for; those trees
    come from replays of the builder's own graphs (v2_speculator.capture_builder), never
    from its eager body. (On the H100, 2026-12-07e: 38 of 52 steps' builds, none eager:
    the others replayed inside graphs that vLLM's speculator still captured.)"""
    config = {"method": "dominotree", "model": str(dirs[1]), "model_runner": "v2"}
    tokens, stats = generate(dirs, config, compilation_config={"max_cudagraph_capture_size": 8})
    print("conditional-v2-capture8", stats)
    assert tokens == expected[: len(PROMPTS)]
    assert stats["graph_builds"] > 0 and stats["eager_builds"] == 0
    assert stats["graph_descriptions"] >= stats["steps"] and stats["eager_descriptions"] == 0


# 40 requests: 680 verification rows, 640 of the drafter's block, past vLLM's capture
# ceiling of 512 tokens (the plugin's own sizes reach them, graph_sizes.py).
WIDE = [[(k * i + 3 * k) % 61 for i in range(4 + k % 9)] for k in range(40)]


@pytest.fixture(scope="module")
def expected_wide(dirs):
    return generate(dirs, None, prompts=WIDE, enforce_eager=True, max_num_seqs=40)[0]


@pytest.mark.parametrize("model_runner", ["v1", "v2"])
def test_decode_steps_past_vllms_capture_ceiling_run_in_graphs(dirs, expected_wide, model_runner):
    """40 trees a step: vLLM's own capture sizes stop at 30 of them, so without the
    plugin's sizes V1 would verify them eagerly and V2's drafts would run outside
    DFlash's graph (its builds by the builder's own graph)."""
    config = {"method": "dominotree", "model": str(dirs[1]), "model_runner": model_runner}
    tokens, stats = generate(dirs, config, prompts=WIDE, max_num_seqs=40)
    print(f"wide-{model_runner}", stats)
    assert tokens == expected_wide
    assert stats["graph_tokens"] == 40 * 17  # vLLM's own stop at 512
    if model_runner == "v1":
        assert stats["full_graph_steps"] > 0.8 * stats["steps"]
        assert stats["graph_builds"] >= stats["steps"] and stats["eager_builds"] == 0
    else:
        # Every build inside DFlash's FULL graphs, none by the builder's own graph.
        assert stats["graph_builds"] == stats["eager_builds"] == 0
        assert stats["vllm:spec_decode_num_drafts"] > 0


@pytest.mark.parametrize("step", ["default", "torch"])
@pytest.mark.parametrize("model_runner", ["v1", "v2"])
def test_node_steps_of_a_top_m_restriction_equal_no_speculation(dirs, expected, model_runner, step):
    """The conditional scorer's per-node step over a top-M restriction (16 candidates of
    the toy pair's 64 tokens) inside the engine's build graphs, on either runner: by
    default the Triton launches (kernels/domino_step.py, config.node_step), and the
    torch step when DOMINOTREE_NODE_STEP asks for it."""
    config = {
        "method": "dominotree",
        "model": str(dirs[1]),
        "scorer": "conditional",
        "candidates": 16,
        "model_runner": model_runner,
    }
    env = {} if step == "default" else {"DOMINOTREE_NODE_STEP": step}
    tokens, stats = generate(dirs, config, env=env)
    print(f"{step}-{model_runner}", stats)
    assert tokens == expected[: len(PROMPTS)]
    assert stats["scorer_step"] == ("triton" if step == "default" else step)
    assert stats["sibling_accepts"] > 0 and stats["kv_moves"] > 0


def test_a_draft_vocabulary_on_cuda_equals_no_speculation(dirs, expected, tmp_path):
    """`draft_vocab` on CUDA (0 there by default): the drafter's logits, the top M and the
    Triton node step (CUDA's default) over 32 of the toy pair's 64 tokens (the 32 the
    target emits most often, so that trees still branch and siblings get accepted), inside
    the V2 runner's build graphs. The target still decides every token."""
    import torch

    counts = collections.Counter(t for out in expected[: len(PROMPTS)] for t in out)
    ranking = sorted(range(PairSpec.vocab), key=lambda t: (-counts[t], t))
    ranked = shutil.copytree(dirs[1], tmp_path / "ranked")
    write_ranking(ranked, torch.tensor(ranking))
    config = {
        "method": "dominotree",
        "model": str(ranked),
        "scorer": "conditional",
        "candidates": 16,
        "draft_vocab": 32,
        "model_runner": "v2",
    }
    tokens, stats = generate(dirs, config)
    print("draft-vocab", stats)
    assert tokens == expected[: len(PROMPTS)]
    assert stats["draft_vocab"] == 32 and stats["scorer_step"] == "triton"
    assert stats["sibling_accepts"] > 0 and stats["kv_moves"] > 0


def test_sampled_requests_on_the_v2_runner_follow_the_target(dirs):
    """Seeded requests with temperature, top-k and top-p through V2 trees follow the
    target's own law (the CPU tests sample with temperature alone: V2's top-k / top-p
    kernel fails in Triton's interpreter); sampled steps accept eagerly."""
    from vllm import SamplingParams

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from engine.conftest import SAMPLED_PARAMS, SAMPLED_PROMPT, assert_runs_follow_the_target

    temperature, top_k, top_p = SAMPLED_PARAMS
    params = [
        SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=3,
                       seed=s, ignore_eos=True)
        for s in range(600)
    ]  # fmt: skip
    config = {"method": "dominotree", "model": str(dirs[1]), "model_runner": "v2"}
    tokens, stats = generate(dirs, config, prompts=[SAMPLED_PROMPT] * 600, params=params)
    print("sampled-v2", stats)
    assert stats["eager_accepts"] > 0 and stats["graph_accepts"] == 0
    assert stats["accepted_tokens"] > 0
    assert_runs_follow_the_target([SAMPLED_PROMPT + t for t in tokens], str(dirs[0]))


def test_mixed_prefill_and_trees_piecewise(dirs, expected):
    """Also the synchronous scheduling path on CUDA (the user's async_scheduling=False)."""
    config = {"method": "dominotree", "model": str(dirs[1])}
    tokens, stats = generate(
        dirs,
        config,
        prompts=MIXED,
        max_num_batched_tokens=96,
        enable_chunked_prefill=True,
        async_scheduling=False,
    )
    print("mixed", stats)
    assert tokens == expected
    assert stats["async_scheduling"] is False
    assert stats["piecewise_steps"] > 0 and stats["full_graph_steps"] > 0
    assert stats["sibling_accepts"] > 0
    # Mixed steps too accept through the graphs (their prefill rows are rows of no tree).
    assert stats["graph_accepts"] >= stats["steps"] and stats["eager_accepts"] == 0


def test_greedy_eager(dirs, expected):
    config = {"method": "dominotree", "model": str(dirs[1])}
    tokens, stats = generate(dirs, config, enforce_eager=True)
    assert tokens == expected[: len(PROMPTS)]
    assert stats["eager_steps"] == stats["steps"] > 0 and stats["kv_moves"] > 0
    assert stats["graph_builds"] == 0 and stats["eager_builds"] >= stats["steps"]
    assert stats["prepared_in_build"] == stats["eager_builds"]  # the same function, eager
    assert stats["graph_accepts"] == 0 and stats["eager_accepts"] >= stats["steps"]
    assert stats["graph_descriptions"] == 0 and stats["eager_descriptions"] == stats["steps"]
    assert stats["graph_drafts"] == 0 and stats["eager_drafts"] >= stats["steps"]


def test_the_drafters_graph_drafts_what_vllms_pass_drafts(
    dirs, expected, default_runs, monkeypatch
):
    """The query pass as the plugin's graph with the logits and the scorer's preparation
    in the build's graph (the defaults), and as vLLM's piecewise pass with them eager
    before the build (DOMINOTREE_DRAFT_GRAPHS=0, DOMINOTREE_PREPARE_IN_BUILD=0), draft
    the same trees: float32, same kernels, so the same acceptance to the token."""
    config = {"method": "dominotree", "model": str(dirs[1])}
    graph_tokens, graph = default_runs("conditional")
    monkeypatch.setenv("DOMINOTREE_DRAFT_GRAPHS", "0")
    monkeypatch.setenv("DOMINOTREE_PREPARE_IN_BUILD", "0")
    pass_tokens, piecewise = generate(dirs, config)
    print("drafts", graph, piecewise)
    assert graph_tokens == pass_tokens == expected[: len(PROMPTS)]
    assert graph["graph_drafts"] > 0 and graph["eager_drafts"] == 0
    assert piecewise["graph_drafts"] == 0 and piecewise["eager_drafts"] > 0
    assert graph["prepared_in_build"] > 0 and piecewise["prepared_in_build"] == 0
    for name in ("trees", "accepted_tokens", "sibling_accepts", "tree_leaves"):
        assert graph[name] == piecewise[name], name


def test_seeded_sampling_is_the_same_with_and_without_async_scheduling(dirs):
    """A seeded request's tokens are a function of its seed and the target (keyed noise,
    engine/acceptance.py): scheduling a step ahead must not change them, mixed prefill
    and preemption-free decode alike; the sampled steps accept eagerly."""
    from vllm import SamplingParams

    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=48, ignore_eos=True)
        for i in range(len(MIXED))
    ]
    config = {"method": "dominotree", "model": str(dirs[1])}
    runs = {}
    for mode in (True, False):
        runs[mode] = generate(dirs, config, prompts=MIXED, params=params, async_scheduling=mode)
    (on, on_stats), (off, off_stats) = runs[True], runs[False]
    print("seeded", on_stats, off_stats)
    assert on_stats["async_scheduling"] is True and off_stats["async_scheduling"] is False
    assert on == off
    assert on_stats["eager_accepts"] > 0 and on_stats["accepted_tokens"] > 0
    assert len({tuple(t) for t in on}) > 1


def test_paths_attention_refused_without_fa3(dirs, monkeypatch, capfd):
    """float32 runs on vLLM's Triton backend: FA3 path requests are refused at startup
    (in the engine's worker, whose message vLLM logs before its own)."""
    monkeypatch.setenv("DOMINOTREE_CUDA_TREE_ATTENTION", "paths")
    config = {"method": "dominotree", "model": str(dirs[1])}
    with pytest.raises(RuntimeError):
        generate(dirs, config, enforce_eager=True)
    assert "needs vLLM's FlashAttention backend with FA3" in capfd.readouterr().err
