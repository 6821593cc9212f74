"""The trace (engine/profiling.py): each kernel's milliseconds go to the innermost stage
range around its start on the device's timeline, each host wait to the innermost named
range around it. The kernel events are shaped as torch's profiler gives them (device_type,
name, time_range in microseconds); a real trace needs CUDA (benchmarks/round_cost_bench.py
records it on the GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from vllm_dominotree.engine.profiling import count_by_scope, kernels_by_stage
from vllm_dominotree.stage_clock import LABEL_PREFIX


def event(name, start, end, device=DeviceType.CUDA, annotation=None):
    """A profiler event; ranges (the stages, vLLM's scopes) are user annotations."""
    if annotation is None:
        annotation = name.startswith(LABEL_PREFIX)
    return SimpleNamespace(
        name=name,
        device_type=device,
        time_range=SimpleNamespace(start=start, end=end),
        is_user_annotation=annotation,
    )


def test_kernels_go_to_the_innermost_stage_around_their_start():
    events = [
        event(LABEL_PREFIX + "step", 0, 1000),
        event(LABEL_PREFIX + "verify", 100, 400),
        event(LABEL_PREFIX + "build", 500, 700),
        event(LABEL_PREFIX + "step", 2000, 2500),
        event("gemm", 120, 300),  # verify
        event("fixup", 300, 390),  # verify
        event("pop", 500, 520),  # build: begins with it
        event("pop", 690, 720),  # build: began inside, ends after
        event("sampler", 800, 850),  # step only
        event("gemm", 2100, 2200),  # the second step
        event("stray", 1500, 1510),  # in no stage
        event("Memcpy DtoH (Device -> Pinned)", 130, 140),  # a copy engine's: left out
        event("Memset (Device)", 510, 512),
        event("aten::mm", 120, 300, device=DeviceType.CPU),  # the host's: left out
        # vLLM's own scopes on the device's timeline: ranges, not kernels, and no stages.
        event("gpu_model_runner: preprocess", 90, 1000, annotation=True),
        event("gpu_model_runner: draft", 1400, 1600, annotation=True),
    ]
    got, top = kernels_by_stage(events)
    assert got == pytest.approx({"verify": 0.27, "build": 0.05, "step": 0.15, "outside": 0.01})
    assert kernels_by_stage([event("k", 0, 5)])[0] == {"outside": 0.005}
    assert kernels_by_stage([]) == ({}, {})

    # The same placement, kernel by kernel: calls and milliseconds, the largest first.
    assert set(top) == {"verify", "build", "step", "outside"}
    assert [(k["kernel"], k["calls"]) for k in top["verify"]] == [("gemm", 1), ("fixup", 1)]
    assert [k["ms"] for k in top["verify"]] == pytest.approx([0.18, 0.09])
    assert top["build"] == [{"kernel": "pop", "calls": 2, "ms": pytest.approx(0.05)}]
    assert top["step"][0]["kernel"] == "gemm" and top["step"][0]["calls"] == 1
    assert [k["kernel"] for k in kernels_by_stage(events, top=1)[1]["verify"]] == ["gemm"]


def test_host_calls_count_in_the_innermost_named_range_around_them():
    """count_by_scope on a real (CPU) profiler trace: torch ops stand in for CUDA's wait
    calls, which only a GPU trace has; the ranges are a plugin stage and a vLLM scope."""
    x = torch.ones(4)
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        with record_function(LABEL_PREFIX + "verify"):
            torch.neg(x)
        with record_function("gpu_model_runner: forward"):
            with record_function(LABEL_PREFIX + "draft"):
                torch.neg(x)
            torch.neg(x)
            torch.exp(x)
        torch.neg(x)
    host = [e for e in trace.events() if e.device_type == DeviceType.CPU]
    assert count_by_scope(host, ("aten::neg",)) == {
        "verify": 1,
        "draft": 1,
        "gpu_model_runner: forward": 1,
        "outside": 1,
    }
    assert count_by_scope(host, ("aten::exp",)) == {"gpu_model_runner: forward": 1}
    assert count_by_scope(host, ("cudaEventSynchronize",)) == {}
