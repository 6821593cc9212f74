"""Bad configurations fail at startup, in process 0, with a message naming the problem;
unsupported per-request options fail that request only."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from vllm_dominotree.config import (
    CPU_BUDGET,
    DominoTreeConfig,
    DominoTreeConfigError,
    accept_kernel,
    node_step,
)
from vllm_dominotree.demo.toy_pair import PairSpec, write_drafter
from vllm_dominotree.drafter.checkpoint import read_spec
from vllm_dominotree.patches import engine_args
from vllm_dominotree.patches.engine_args import check_engine_config, slow_bfloat16_warning
from vllm_dominotree.speculative import translate
from vllm_dominotree.tree import TreeShape

from .conftest import PROMPTS, dominotree, greedy, make_llm


@pytest.mark.parametrize(
    "options, message",
    [
        ({"scorer": "beam"}, "scorer 'beam' is unknown"),
        ({"budgett": 16}, "unknown DominoTree option(s) ['budgett']"),
        ({"budget": 0}, "budget must be a positive integer"),
        ({"budget": 100}, "budget 100 is over 64"),
        ({"candidates": "many"}, "candidates must be a positive integer"),
        ({"num_speculative_tokens": 9}, "contradicts the tree's node budget 16"),
        ({"spine": "yes"}, "spine must be true or false"),
        ({"max_leaves": -1}, "max_leaves must be 0 (no limit) or a positive integer, got -1"),
        ({"step_leaves": 2.5}, "step_leaves must be 0 (no limit) or a positive integer, got 2.5"),
        ({"step_nodes": -4}, "step_nodes must be 0 (no limit) or a positive integer, got -4"),
        ({"model_runner": "v3"}, "model_runner 'v3' is unknown"),
        (
            {"graph_requests": -8},
            "graph_requests must be 0 (vLLM's capture sizes) or a positive integer, got -8",
        ),
    ],
)
def test_bad_options(pair_dirs, options, message):
    with pytest.raises(DominoTreeConfigError) as err:
        make_llm(pair_dirs, dominotree(pair_dirs, **options))
    assert message in str(err.value)


def test_a_budget_below_the_block_is_cpu_only(pair_dirs, monkeypatch):
    """CPU engines take it (test_generate.py); on CUDA it is refused at startup."""
    import vllm.triton_utils

    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", True)  # as under triton-cpu
    config = dominotree(pair_dirs, budget=5)
    assert translate(config, on_cpu=True)[0]["num_speculative_tokens"] == 7  # the block
    with pytest.raises(DominoTreeConfigError, match="only the CPU engine supports"):
        translate(config, on_cpu=False)
    # ... on the tree runner: V2 would verify the block's slots past the budget.
    with pytest.raises(DominoTreeConfigError, match="only model_runner 'v1' supports"):
        translate(config | {"model_runner": "v2"}, on_cpu=True)


def test_step_nodes_are_the_cpu_tree_runners(pair_dirs, monkeypatch):
    """A step's share of nodes verifies fewer rows only where vLLM schedules the drafts
    as proposed (CPU, V1: test_generate.py); elsewhere it is refused at startup."""
    import vllm.triton_utils

    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", True)  # as under triton-cpu
    config = dominotree(pair_dirs, step_nodes=8)
    assert translate(config, on_cpu=True)[1]["step_nodes"] == 8
    # Unset: a CPU tree runner's step shares one request's budget; elsewhere none.
    written_out = {"method": "dominotree", "model": pair_dirs["drafter"]}
    assert translate(written_out, on_cpu=True)[1]["step_nodes"] == CPU_BUDGET
    assert translate(written_out | {"budget": 6}, on_cpu=True)[1]["step_nodes"] == 6
    assert (
        translate(written_out | {"model_runner": "v2", "budget": 7}, on_cpu=True)[1]["step_nodes"]
        == 0
    )
    assert translate(written_out, on_cpu=False)[1]["step_nodes"] == 0
    for on_cpu, runner in ((False, "v1"), (False, "v2"), (True, "v2")):
        with pytest.raises(DominoTreeConfigError, match="step_nodes 8 applies to the CPU"):
            translate(config | {"model_runner": runner}, on_cpu=on_cpu)


def test_the_v2_runner_on_cpu_needs_a_triton_cpu_backend(pair_dirs):
    """This machine's Triton has none (test_v2_on_cpu.py stands one in, in its engines'
    own processes)."""
    with pytest.raises(DominoTreeConfigError, match="needs a Triton with a CPU backend"):
        make_llm(pair_dirs, dominotree(pair_dirs, model_runner="v2"))


def test_the_v2_runner_takes_every_scorer_on_both_devices(pair_dirs, monkeypatch):
    """Chain and trees on V2, on CPU (test_v2_on_cpu.py) and CUDA (tests/gpu)."""
    import vllm.triton_utils

    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", True)  # as under triton-cpu
    for scorer in ("chain", "marginal", "conditional"):
        config = dominotree(pair_dirs, model_runner="v2", scorer=scorer)
        for on_cpu in (True, False):
            assert translate(config, on_cpu=on_cpu)[1]["model_runner"] == "v2"


def test_the_default_budget_is_per_device(pair_dirs):
    config = {"method": "dominotree", "model": pair_dirs["drafter"]}
    assert translate(config, on_cpu=True)[1]["budget"] == CPU_BUDGET
    assert translate(config, on_cpu=False)[1]["budget"] == DominoTreeConfig().budget == 16
    # The chain on CUDA verifies DFlash's rows: the drafter's block less one draft.
    chain = {**config, "scorer": "chain"}
    block = read_spec(pair_dirs["drafter"]).block_size
    assert translate(chain, on_cpu=False)[1]["budget"] == block - 1 < 16
    assert translate(chain, on_cpu=True)[1]["budget"] == CPU_BUDGET
    assert translate({**chain, "budget": 16}, on_cpu=False)[1]["budget"] == 16


def test_conditional_needs_domino(pair_dirs):
    config = {"method": "dominotree", "model": pair_dirs["dflash"], "scorer": "conditional"}
    with pytest.raises(DominoTreeConfigError, match="needs a Domino checkpoint"):
        make_llm(pair_dirs, config)


def test_missing_or_broken_drafter(pair_dirs, tmp_path):
    with pytest.raises(DominoTreeConfigError, match='needs "model"'):
        make_llm(pair_dirs, {"method": "dominotree"})
    with pytest.raises(
        DominoTreeConfigError, match=re.escape(f"{tmp_path}/config.json: not found")
    ):
        make_llm(pair_dirs, {"method": "dominotree", "model": str(tmp_path)})
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(DominoTreeConfigError, match="'architectures'"):
        make_llm(pair_dirs, {"method": "dominotree", "model": str(tmp_path)})


@pytest.mark.parametrize(
    "spec, field",
    [
        (PairSpec(noise=0.8, hidden=32), "'hidden_size' is 32"),
        (PairSpec(noise=0.8, vocab=48), "'vocab_size' is 48"),
    ],
)
def test_drafter_for_another_target(pair_dirs, tmp_path, spec, field):
    drafter = write_drafter(tmp_path / "other", spec)
    with pytest.raises(DominoTreeConfigError) as err:
        make_llm(pair_dirs, {"method": "dominotree", "model": str(drafter)})
    assert field in str(err.value) and "another target" in str(err.value)


def test_drafter_reading_layers_the_target_lacks(pair_dirs, tmp_path):
    drafter = write_drafter(
        tmp_path / "deep", PairSpec(noise=0.8, target_layers=12, draft_layers=2)
    )
    with pytest.raises(DominoTreeConfigError, match=r"names layers \[.*\] but the target has 4"):
        make_llm(pair_dirs, {"method": "dominotree", "model": str(drafter)})


def test_pipeline_parallelism_is_refused(pair_dirs):
    with pytest.raises(DominoTreeConfigError, match="set pipeline_parallel_size=1"):
        make_llm(pair_dirs, dominotree(pair_dirs), pipeline_parallel_size=2)


def test_scheduling_is_vllms_choice_in_both_cuda_tree_attention_modes(pair_dirs, monkeypatch):
    """Asynchronous scheduling is vLLM's to choose (on for DFlash on CUDA, off on CPU),
    with the fix-up kernel and with FA3 path requests alike: the path requests' tables
    are built on the device (tree_paths.PathTables.build), so no step waits for its trees."""
    from vllm.engine.arg_utils import EngineArgs

    def args(**options):
        return EngineArgs(
            model=pair_dirs["target"], speculative_config=dominotree(pair_dirs), **options
        )

    monkeypatch.setattr(engine_args.current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(engine_args.current_platform, "is_cuda", lambda: True)
    for mode in ("auto", "fixup", "paths", "one-pass", "one-pass-fixup"):
        monkeypatch.setenv("DOMINOTREE_CUDA_TREE_ATTENTION", mode)
        for asked in (True, False, None):
            prepared = args(async_scheduling=asked)
            engine_args.prepare_engine_args(prepared)
            assert prepared.async_scheduling is asked, (mode, asked)


def test_data_parallelism_is_refused(pair_dirs):
    """`LLM` refuses data_parallel_size > 1 itself; the API server's engine args (and
    any EngineArgs) reach the plugin, which names the option."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=pair_dirs["target"], data_parallel_size=2, speculative_config=dominotree(pair_dirs)
    )
    with pytest.raises(DominoTreeConfigError, match="set data_parallel_size=1"):
        args.create_engine_config()


@pytest.mark.parametrize(
    "step, message",
    [("triton", "runs the scorer's step as CUDA kernels"), ("cuda", "use one of")],
)
def test_node_step_switch_is_checked_at_engine_start(pair_dirs, monkeypatch, step, message):
    """DOMINOTREE_NODE_STEP: a value it does not know, and the Triton step on CPU, are
    refused before any worker starts, naming the variable."""
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("DOMINOTREE_NODE_STEP", step)
    args = EngineArgs(model=pair_dirs["target"], speculative_config=dominotree(pair_dirs))
    with pytest.raises(DominoTreeConfigError, match="DOMINOTREE_NODE_STEP") as error:
        args.create_engine_config()
    assert message in str(error.value)


@pytest.mark.parametrize(
    "kind, message",
    [("triton", "CUDA kernel"), ("radix", "use one of")],
)
def test_accept_kernel_switch_is_checked_at_engine_start(pair_dirs, monkeypatch, kind, message):
    """DOMINOTREE_ACCEPT_KERNEL: an unknown value, and the Triton kernel on CPU (the
    default on CUDA only), are refused before any worker starts, naming the variable."""
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("DOMINOTREE_ACCEPT_KERNEL", kind)
    args = EngineArgs(model=pair_dirs["target"], speculative_config=dominotree(pair_dirs))
    with pytest.raises(DominoTreeConfigError, match="DOMINOTREE_ACCEPT_KERNEL") as error:
        args.create_engine_config()
    assert message in str(error.value)


def test_accept_kernel_defaults_to_the_kernel_on_cuda_only(monkeypatch):
    """CUDA accepts with the fused kernel unless told otherwise; CPU with torch code."""
    monkeypatch.delenv("DOMINOTREE_ACCEPT_KERNEL", raising=False)
    assert accept_kernel(cuda=True) == "triton" and accept_kernel(cuda=False) == "torch"
    monkeypatch.setenv("DOMINOTREE_ACCEPT_KERNEL", "torch")
    assert accept_kernel(cuda=True) == "torch"


def test_node_step_defaults_to_the_triton_step_where_it_applies(monkeypatch):
    """CUDA runs the Triton node step wherever it can (the conditional scorer's trees and
    Domino's chain with a top-M restriction), the torch step elsewhere; the variable
    overrides either way, within what can run."""
    monkeypatch.delenv("DOMINOTREE_NODE_STEP", raising=False)
    assert node_step("conditional", 64, 151936, cuda=True) == "triton"
    assert node_step("chain", 64, 151936, cuda=True) == "triton"
    assert node_step("chain", 151936, 151936, cuda=True) == "torch"  # the released decoder
    assert node_step("conditional", 64, 64, cuda=True) == "torch"  # the whole vocabulary
    assert node_step("conditional", 64, 151936, cuda=False) == "torch"
    assert node_step("marginal", 64, 151936, cuda=True) == "torch"
    monkeypatch.setenv("DOMINOTREE_NODE_STEP", "torch")
    assert node_step("conditional", 64, 151936, cuda=True) == "torch"
    monkeypatch.setenv("DOMINOTREE_NODE_STEP", "triton")
    assert node_step("conditional", 16, 64, cuda=True) == "triton"
    assert node_step("marginal", 64, 64, cuda=True) == "torch"  # no node step to run
    for scorer in ("conditional", "chain"):
        with pytest.raises(DominoTreeConfigError, match="candidates is 64: set candidates below"):
            node_step(scorer, 64, 64, cuda=True)


@pytest.mark.parametrize("candidates", [64, 16])
def test_triton_step_without_a_top_m_restriction_is_refused_at_startup(
    pair_dirs, monkeypatch, candidates
):
    """DOMINOTREE_NODE_STEP=triton needs candidates below the drafter's logits (the toy
    pair's 64): refused in process 0, naming both and the fix, where the worker's engine
    core used to fail to start (H100, 2026-12-05e); with 16 candidates it passes. (The
    check runs on the engine's real config, made on CPU, where the variable is refused
    outright: it is called here as on CUDA, with the variable set after the config is
    made.)"""
    from vllm.engine.arg_utils import EngineArgs

    options = dominotree(pair_dirs, candidates=candidates)
    args = EngineArgs(model=pair_dirs["target"], speculative_config=options)
    config = args.create_engine_config()
    monkeypatch.setenv("DOMINOTREE_NODE_STEP", "triton")
    monkeypatch.setattr(engine_args.current_platform, "is_cuda", lambda: True)
    if candidates == 16:
        check_engine_config(config)
        return
    with pytest.raises(DominoTreeConfigError, match="DOMINOTREE_NODE_STEP=triton") as error:
        check_engine_config(config)
    assert "drafter's 64 logits, but candidates is 64: set candidates below 64" in str(error.value)


def test_recurrent_targets_are_refused():
    config = SimpleNamespace(
        model_config=SimpleNamespace(model="some/mamba", is_hybrid=True, is_attention_free=False)
    )
    with pytest.raises(DominoTreeConfigError, match="recurrent"):
        check_engine_config(config)


@pytest.mark.parametrize("mode", ["processed_logprobs", "processed_logits"])
def test_processed_logprobs_modes_are_refused_at_startup(pair_dirs, mode):
    """The tree runner reports the target's raw logprobs (test_logprobs.py)."""
    with pytest.raises(DominoTreeConfigError, match=f"logprobs_mode='{mode}'") as error:
        make_llm(pair_dirs, dominotree(pair_dirs), logprobs_mode=mode)
    assert "set logprobs_mode to raw_logprobs" in str(error.value)


@pytest.mark.parametrize(
    "option",
    [
        {"bad_words": ["ab"]},
        {"logprob_token_ids": [3, 5]},
    ],
)
def test_unsupported_request_options_fail_that_request_only(conditional, baseline, option):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    name = next(iter(option))
    with pytest.raises(VLLMValidationError) as err:
        conditional.generate(
            [{"prompt_token_ids": PROMPTS[1]}], SamplingParams(max_tokens=8, **option)
        )
    assert name in str(err.value) and "dominotree" in str(err.value)
    # The engine keeps serving.
    assert greedy(conditional, PROMPTS[:1], 16) == greedy(baseline, PROMPTS[:1], 16)


@pytest.mark.parametrize(
    "option",
    [
        {"logprobs": 2},
        {"presence_penalty": 0.5},
        {"frequency_penalty": 0.5},
        {"repetition_penalty": 1.2},
        {"min_p": 0.1},
        {"min_tokens": 3},
        {"logit_bias": {3: 1.0}},
        {"allowed_token_ids": [3, 5]},
    ],
)
def test_what_the_v2_runner_lacks_is_refused_there_only(option):
    """The V1 tree runner honours these (test_logprobs.py, test_sampling_constraints.py); the V2
    runner's trees do not yet, and its engine refuses them with the way out. The OpenAI
    check, which does not know the engine's runner, leaves them to the engine."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    from vllm_dominotree.patches.input_processor import refuse_unsupported, unsupported_features

    params = SamplingParams(**option)
    assert unsupported_features(params, "v1") == unsupported_features(params) == []
    assert unsupported_features(params, "v2") == list(option.items())
    with pytest.raises(VLLMValidationError, match="on model_runner 'v2'") as error:
        refuse_unsupported(params, "v2")
    assert "the default 'v1' honours it" in str(error.value)


def test_structured_outputs_are_refused(conditional):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import StructuredOutputsParams

    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(VLLMValidationError, match="structured_outputs"):
        conditional.generate([{"prompt_token_ids": PROMPTS[1]}], params)


def test_the_chain_is_a_path_of_budget_drafts():
    """The chain takes `budget` drafts, or the block's where the budget is larger (CUDA's
    16 for a block of 16); trees reach at most their budget's depth."""
    chain = DominoTreeConfig(scorer="chain", budget=4).tree_shape(16)
    assert chain == TreeShape(budget=4, max_depth=4, max_children=1)
    assert DominoTreeConfig(scorer="chain", budget=16).tree_shape(16) == TreeShape(16, 16, 1)
    assert DominoTreeConfig(scorer="chain", budget=32).tree_shape(16) == TreeShape(16, 16, 1)
    tree = DominoTreeConfig(scorer="conditional", budget=4).tree_shape(16)
    assert tree == TreeShape(budget=4, max_depth=4, max_children=4, step_leaves=64)
    # a tree's leaf limit reaches its shape (0: none, as many branches as the budget)
    limited = DominoTreeConfig(scorer="conditional", max_leaves=4).tree_shape(16)
    assert limited.max_leaves == 4 and limited.max_branches == 3
    assert tree.max_leaves == 0 and tree.max_branches == tree.budget
    # so does the step's (the default 64 shared over a step's padded rows, 0: none)
    assert DominoTreeConfig(step_leaves=0).tree_shape(16).step_leaves == 0


def test_bfloat16_on_a_cpu_without_native_bf16_is_named_at_startup(pair_dirs, monkeypatch):
    """A CPU engine in bfloat16 on a CPU without AVX512-BF16 or AMX is told why speculation
    will not pay there and what to do; float32, or a CPU with native bf16, hears nothing."""
    import torch

    assert "--dtype float32" in slow_bfloat16_warning(torch.bfloat16, native_bf16=False)
    assert slow_bfloat16_warning(torch.bfloat16, native_bf16=True) is None
    assert slow_bfloat16_warning(torch.float32, native_bf16=False) is None
    # The engine's config (its check, patches/engine_args.py, runs there) reads the
    # target's dtype and the CPU's capabilities.
    from vllm.engine.arg_utils import EngineArgs

    warnings = []
    monkeypatch.setattr(engine_args.logger, "warning", warnings.append)
    from vllm.platforms.interface import CpuArchEnum

    monkeypatch.setattr(
        engine_args.current_platform, "get_cpu_architecture", lambda: CpuArchEnum.X86
    )
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    for dtype in ("bfloat16", "float32"):
        args = EngineArgs(
            model=pair_dirs["target"], dtype=dtype, speculative_config=dominotree(pair_dirs)
        )
        args.create_engine_config()
    assert warnings == [slow_bfloat16_warning(torch.bfloat16, native_bf16=False)]
