"""The real pair on CUDA in float32: SmolLM2-135M-Instruct with its shipped Domino drafter
gives exactly the target's own greedy tokens; and the tree rows the engine recomputes,
in float32 and in bf16, are right up to rounding.

The toy pairs of test_engine_gpu.py have one KV head of 32 dims, four layers and the trees
a toy drafter grows; this pair has 9 query heads on 3 KV heads (a group of 3), 64 dims,
30 layers, prompts that share a chat template, the deep, branching trees of a trained
drafter, and greedy choices with near-ties that any difference in rounding flips.

float32 runs vLLM's Triton backend, whose products are TF32 by Triton's default, and whose
decoding (its 3D kernel, 16-key tiles in segments) and verification (its 2D kernel, 32-key
tiles) round apart: under TF32 even the plugin's chain, every row of it the stock
kernel's, left this pair's output on the H200 (2026-12-02), as any speculative method's
verified rows would. Exact float32 means IEEE products, so every engine here, the target
alone included, runs with TRITON_F32_DEFAULT=ieee (vLLM's kernels and the plugin's alike).
Needs DOMINOTREE_SMOLLM2 (scripts/gpu_jobs.sh converts the GGUF).
"""

from __future__ import annotations

import pytest

from vllm_dominotree.training.smollm2 import DRAFTER_DIR

from .sharing import engine_memory, run_engine, smollm2_prompts

NUM_PROMPTS = 32
MAX_TOKENS = 96
IEEE = {"TRITON_F32_DEFAULT": "ieee"}


@pytest.fixture(scope="module")
def pair():
    return smollm2_prompts(NUM_PROMPTS)


def generate(pair, speculative_config, **engine):
    from vllm import SamplingParams

    target, prompts = pair
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return run_engine(
        target,
        prompts,
        params,
        speculative_config,
        IEEE,
        dtype="float32",
        max_model_len=2048,
        **engine_memory(kv_gib=2),
        **engine,
    )


@pytest.fixture(scope="module")
def expected(pair):
    return generate(pair, None)[0]


@pytest.mark.parametrize(
    "scorer, engine",
    [
        pytest.param("conditional", {}, id="conditional"),
        pytest.param("conditional", {"max_num_seqs": 4}, id="conditional-batch4"),
        pytest.param("chain", {}, id="chain"),
    ],
)
def test_greedy_float32_equals_the_target_alone(pair, expected, scorer, engine):
    config = {"method": "dominotree", "model": str(DRAFTER_DIR), "scorer": scorer}
    tokens, stats = generate(pair, config, **engine)
    print(scorer, engine, stats)
    first = [
        next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        for got, want in zip(tokens, expected, strict=True)
    ]
    diverged = {p: i for p, i in enumerate(first) if i is not None}
    assert not diverged, f"prompt: first differing token {diverged}"
    assert stats["async_scheduling"] is engine.get("async_scheduling", True)
    if scorer == "conditional":
        # The real drafter's trees branch and are accepted past their first children.
        assert stats["sibling_accepts"] > 0 and stats["kv_moves"] > 0


# (dtype, the engine's tree attention, its environment, the bar). float32 runs the
# Triton fix-up, IEEE rounding apart from the reference; bf16 runs FA3 over path
# requests (the bf16 test's engines), which rounds its probabilities to bf16 before the
# value product (about 2^-8 of the layer's largest value): its bar is relative.
CHECKS = {
    "float32-fixup": ("float32", "fixup", IEEE, ("max_error", 1e-3)),
    # The default on FA3: every row of an all-tree step through the path requests (the
    # stock pass skipped), so every row is checked.
    "bfloat16-one-pass": ("bfloat16", "one-pass", {}, ("max_relative_error", 2**-5)),
    # The stock pass, then path requests for the rows it got wrong.
    "bfloat16-paths": (
        "bfloat16",
        "paths",
        {"DOMINOTREE_CUDA_TREE_ATTENTION": "paths"},
        ("max_relative_error", 2**-5),
    ),
    # The stock pass, then the fix-up in FA3's steps for those rows; and that kernel for
    # every row of an all-tree step, no stock pass.
    "bfloat16-fixup": (
        "bfloat16",
        "fixup",
        {"DOMINOTREE_CUDA_TREE_ATTENTION": "fixup"},
        ("max_relative_error", 2**-5),
    ),
    # FA3 over each request's prefix, the tree part and the merge (kernels/tree_merge.py).
    "bfloat16-one-pass-merge": (
        "bfloat16",
        "one-pass-merge",
        {"DOMINOTREE_CUDA_TREE_ATTENTION": "one-pass-merge"},
        ("max_relative_error", 2**-5),
    ),
    "bfloat16-one-pass-fixup": (
        "bfloat16",
        "one-pass-fixup",
        {"DOMINOTREE_CUDA_TREE_ATTENTION": "one-pass-fixup"},
        ("max_relative_error", 2**-5),
    ),
}


@pytest.mark.parametrize("case", CHECKS)
def test_recomputed_rows_are_right_up_to_rounding(pair, case):
    """Eager, with DOMINOTREE_CHECK_TREE_ATTENTION=1: every row the engine recomputed,
    in every layer of every step, against the dense float32 reference: rounding apart,
    where a row with a wrong key set is off by 0.1 and more (tens of percent)."""
    from vllm import SamplingParams

    dtype, attention, env, (figure, bar) = CHECKS[case]
    target, prompts = pair
    config = {"method": "dominotree", "model": str(DRAFTER_DIR), "scorer": "conditional"}
    _, stats = run_engine(
        target,
        prompts[:8],
        SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
        config,
        {"DOMINOTREE_CHECK_TREE_ATTENTION": "1", **env},
        dtype=dtype,
        max_model_len=2048,
        enforce_eager=True,
        **engine_memory(kv_gib=2),
    )
    check = stats["tree_attention_check"]
    print("tree attention check", check, stats["tree_attention"])
    assert stats["tree_attention"] == attention and check["rows"] > 0
    assert (stats["one_pass_steps"] > 0) == attention.startswith("one-pass")
    assert check[figure] < bar, check


def test_one_pass_keeps_a_prefill_of_tree_length_out_of_full_graphs(pair):
    """One pass, bf16: with prompts of budget + 1 tokens vLLM calls uniform (a FULL
    graph, where the path requests would hold the trees' rows only) both the first step
    (two prefills) and the steps where a request admitted while another decodes prefills
    beside its tree. The runner runs such steps piecewise (counted), and every output
    stays the target's own up to flipped near-ties."""
    from divergence_stats import diverged, not_near_ties
    from vllm import SamplingParams

    target, prompts = pair
    rows = 17  # budget 16 (CUDA's default) + the root
    prompts = [p[-rows:] for p in prompts[:6]]  # distinct endings, no shared prefix
    lengths = [24, 56, 32, 48, 40, 28]  # staggered: requests finish and are admitted apart

    def params(logprobs=None):
        return [
            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=logprobs)
            for n in lengths
        ]

    engine = dict(
        dtype="bfloat16",
        max_model_len=2048,
        max_num_seqs=2,
        enable_prefix_caching=False,
        **engine_memory(kv_gib=1),
    )
    want, _, margins = run_engine(target, prompts, params(2), margins=True, **engine)
    config = {"method": "dominotree", "model": str(DRAFTER_DIR), "scorer": "conditional"}
    got, stats = run_engine(target, prompts, params(), config, **engine)
    print("one pass", {k: stats[k] for k in ("one_pass_steps", "split_uniform_steps")})
    assert stats["tree_attention"] == "one-pass"  # the default on FA3
    assert stats["split_uniform_steps"] > 0 and stats["one_pass_steps"] > 0
    found = diverged(got, {"want": want, "margins": margins}, "dominotree one-pass")
    assert not_near_ties(found) == []
