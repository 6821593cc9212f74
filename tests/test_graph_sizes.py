"""The decode steps a DominoTree engine captures past vLLM's 512-token ceiling
(graph_sizes.py); the real engines' graphs are checked on the GPU
(tests/gpu/test_engine_gpu.py)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from vllm_dominotree.graph_sizes import (
    add_decode_graph_sizes,
    decode_sizes,
    logger,
    request_grid,
    user_chose_sizes,
)

# vLLM 0.32's sizes below its ceiling on a GPU of compute capability 9 (1, 2, 4, then by
# 8 to 248, then by 16 to 512), with its decode sizes of 17 rows a request (17 x 1 ..
# 17 x 24) among them.
VLLM_SIZES = sorted(
    {1, 2, 4, *range(8, 256, 8), *range(256, 513, 16), *(17 * n for n in (1, 2, 4, 8, 16, 24))}
)


def engine_config(captured, max_num_seqs=64, max_tokens=8192, reserved=16):
    return SimpleNamespace(
        compilation_config=SimpleNamespace(
            cudagraph_capture_sizes=list(captured),
            max_cudagraph_capture_size=captured[-1] if captured else 0,
        ),
        scheduler_config=SimpleNamespace(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens
        ),
        speculative_config=SimpleNamespace(num_speculative_tokens=reserved),
    )


def test_the_request_grid_is_vllms():
    assert request_grid(1) == [1]
    assert request_grid(30) == [1, 2, 4, 8, 16, 24, 30]
    assert request_grid(64) == [1, 2, 4, *range(8, 65, 8)]
    grid = request_grid(300)
    assert grid[-5:] == [248, 256, 272, 288, 300]
    assert request_grid(0) == []


def test_decode_sizes_cover_both_query_lengths_within_the_step():
    sizes = decode_sizes((17, 16), 64, 8192)
    assert 17 * 64 in sizes and 16 * 64 in sizes and 17 * 30 not in sizes
    assert max(decode_sizes((17, 16), 64, 1000)) == 17 * 56  # 16 x 64 is past the step


def test_a_tree_engine_captures_its_decode_steps_past_vllms_ceiling(caplog):
    config = engine_config(VLLM_SIZES)
    with caplog.at_level(logging.INFO):
        logger.addHandler(caplog.handler)  # vLLM's loggers do not propagate to the root
        try:
            added = add_decode_graph_sizes(config, graph_requests=128, draft_rows=16)
        finally:
            logger.removeHandler(caplog.handler)
    # The engine's log says what it captures beyond vLLM's sizes.
    assert "decode steps of up to 64 requests" in caplog.text and "1088" in caplog.text
    # Verification (17 rows a request) and the drafter's block (16), 32 to 64 requests.
    assert added == sorted(
        {*(17 * n for n in (32, 40, 48, 56, 64)), *(16 * n for n in (40, 48, 56, 64))}
    )
    sizes = config.compilation_config.cudagraph_capture_sizes
    assert sizes == sorted({*VLLM_SIZES, *added})
    assert config.compilation_config.max_cudagraph_capture_size == 17 * 64
    # V1's drafter captures its own graphs: the verification's sizes alone.
    config = engine_config(VLLM_SIZES)
    assert add_decode_graph_sizes(config, 128, draft_rows=None) == [
        17 * n for n in (32, 40, 48, 56, 64)
    ]
    # graph_requests bounds it below max_num_seqs.
    config = engine_config(VLLM_SIZES, max_num_seqs=256)
    assert max(add_decode_graph_sizes(config, graph_requests=40, draft_rows=16)) == 17 * 40


@pytest.mark.parametrize(
    "captured, graph_requests", [([], 128), (VLLM_SIZES, 0)], ids=["no-graphs", "option-off"]
)
def test_engines_without_graphs_or_with_the_option_off_keep_vllms_sizes(captured, graph_requests):
    config = engine_config(captured)
    assert add_decode_graph_sizes(config, graph_requests, draft_rows=16) == []
    assert config.compilation_config.cudagraph_capture_sizes == list(captured)


def test_capture_sizes_a_user_names_are_theirs():
    from vllm.config import CompilationConfig
    from vllm.engine.arg_utils import EngineArgs

    assert not user_chose_sizes(EngineArgs(model="m"))
    assert user_chose_sizes(EngineArgs(model="m", max_cudagraph_capture_size=8))
    assert user_chose_sizes(EngineArgs(model="m", cudagraph_capture_sizes=[1, 2]))
    chosen = CompilationConfig(max_cudagraph_capture_size=8)
    assert user_chose_sizes(EngineArgs(model="m", compilation_config=chosen))
    assert user_chose_sizes(SimpleNamespace(compilation_config={"cudagraph_capture_sizes": [4]}))
