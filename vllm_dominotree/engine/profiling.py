"""Where a DominoTree step's time goes on the host and the GPU, for benchmarks (off
unless asked for). The runner's stage clock (stage_clock.py) gives the seconds per stage.

LaunchTrace: `llm.collective_rpc("dominotree_trace", args=(True,))`, run requests, then
`args=(False,)` returns what the worker's host asked of the GPU meanwhile (torch's
profiler over CUDA's runtime and driver API): CUDA graph replays, kernels launched
outside graphs, calls that block the host until the device catches up, and the host's
milliseconds inside each stage (the stages are profiler ranges while tracing), with the
launches and the torch ops the host dispatched (top-level `aten::` calls) counted per
stage too: the innermost stage around each ("step" is vLLM's own work between the
plugin's stages), and the GPU's: the milliseconds its kernels ran, per stage (the
innermost stage range on the device's timeline around each kernel's start). Kernel
milliseconds per step against the round's milliseconds say whether the GPU or the host
sets the round. Each host wait is counted in the innermost named range around it
(count_by_scope): the plugin's stages, or vLLM's own scopes when the engine runs with
VLLM_CUSTOM_SCOPES_FOR_PROFILING=1.
"""

from __future__ import annotations

import bisect
import functools
from collections import defaultdict

from ..stage_clock import LABEL_PREFIX

# CUDA API calls by what they mean for the host.
GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")
KERNEL_LAUNCHES = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaLaunchCooperativeKernel",
)
HOST_WAITS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "cuStreamSynchronize",
    "cuCtxSynchronize",
)


class LaunchTrace:
    def __init__(self):
        self._profiler = None

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        self._profiler.__enter__()

    def stop(self) -> dict:
        """Counts of graph replays, eager kernel launches and host waits since start()
        (plus every CUDA API call by name, and the profiler's tables of host ops and of
        device kernels by self time, for a closer look)."""
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        calls: dict[str, int] = defaultdict(int)
        # stage -> {"graph_launches": n, "kernel_launches": n, "torch_ops": n}
        by_stage: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        events = profiler.events()
        for event in events:
            if event.name.startswith("aten::") and not (
                event.cpu_parent is not None and event.cpu_parent.name.startswith("aten::")
            ):
                by_stage[_innermost_stage(event)]["torch_ops"] += 1
            if event.name.startswith(("cuda", "cu")) and event.device_type.name == "CPU":
                calls[event.name] += 1
                kind = (
                    "graph_launches"
                    if event.name in GRAPH_LAUNCHES
                    else "kernel_launches"
                    if event.name in KERNEL_LAUNCHES
                    else None
                )
                if kind is not None:
                    by_stage[_innermost_stage(event)][kind] += 1

        averages = profiler.key_averages()
        # The host's time inside each stage (StageClock.labels). The profiler lists every
        # range twice, as the host ran it and as projected on the device's timeline (no
        # host time): keep the host's.
        host_ms: dict[str, float] = defaultdict(float)
        for a in averages:
            if a.key.startswith(LABEL_PREFIX):
                name = a.key[len(LABEL_PREFIX) :]
                host_ms[name] = max(host_ms[name], a.cpu_time_total / 1e3)

        def total(names):
            return sum(calls.get(n, 0) for n in names)

        kernel_ms, top_kernels = kernels_by_stage(events)

        return {
            "graph_launches": total(GRAPH_LAUNCHES),
            "kernel_launches": total(KERNEL_LAUNCHES),
            "host_waits": total(HOST_WAITS),
            "host_waits_by_scope": count_by_scope(events, HOST_WAITS),
            "memcpy_async": calls.get("cudaMemcpyAsync", 0),
            "host_ms": dict(host_ms),
            "kernel_ms": sum(kernel_ms.values()),
            "kernel_ms_by_stage": kernel_ms,
            "top_kernels_by_stage": top_kernels,
            "launches_by_stage": {k: dict(v) for k, v in by_stage.items()},
            "calls": dict(calls),
            "host_ops": averages.table(sort_by="self_cpu_time_total", row_limit=40),
            "kernels": averages.table(sort_by="self_cuda_time_total", row_limit=40),
        }


# Where the plugin's V2 runner names its stages (v2_runner.py: execute_model "verify",
# sample_tokens "sample"; v2_speculator.py: the speculator's propose "draft"), vLLM's own
# runners are labelled alike while traced, so a benchmark splits both rounds the same way.
VLLM_STAGES = (("execute_model", "verify"), ("sample_tokens", "sample"))


def _labelled(method, stage: str):
    import torch

    @functools.wraps(method)
    def call(*args, **kwargs):
        with torch.profiler.record_function(LABEL_PREFIX + stage):
            return method(*args, **kwargs)

    return call


def label_vllm_stages(runner, on: bool) -> None:
    """Wrap (on) or unwrap a vLLM runner's stage methods, and its drafter's propose (V2:
    `speculator`, V1: `drafter`), in profiler ranges named as the plugin's stages."""
    drafter = getattr(runner, "speculator", None) or getattr(runner, "drafter", None)
    targets = [(runner, method, stage) for method, stage in VLLM_STAGES]
    if drafter is not None:
        targets.append((drafter, "propose", "draft"))
    for owner, method, stage in targets:
        if on:
            setattr(owner, method, _labelled(getattr(owner, method), stage))
        else:
            vars(owner).pop(method, None)  # the class's method again


class KernelTraceExtension:
    """A vLLM worker extension (`worker_extension_cls`) for benchmarks: LaunchTrace on
    any engine's worker, vLLM's own methods' included, through
    `llm.collective_rpc("kernel_trace", args=(True,))` ... `args=(False,)`."""

    def kernel_trace(self, enabled: bool) -> dict | None:
        # The plugin's V2 runner names its stages while traced (v2_runner.py); vLLM's
        # own runners are labelled at the same points meanwhile.
        clock = getattr(self.model_runner, "stage_clock", None)
        if enabled:
            self._kernel_trace = LaunchTrace()
            self._kernel_trace.start()
            if clock is not None:
                clock.labels = True
            else:
                label_vllm_stages(self.model_runner, on=True)
            return None
        if clock is not None:
            clock.labels = False
        else:
            label_vllm_stages(self.model_runner, on=False)
        return self._kernel_trace.stop()


def _innermost_range(event, prefixes: tuple[str, ...]) -> str:
    """The innermost range around a profiler event whose name starts with one of
    `prefixes` ("" takes any range but torch ops), without the stage prefix; or
    "outside"."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(prefixes) and not parent.name.startswith("aten::"):
            return parent.name.removeprefix(LABEL_PREFIX)
        parent = parent.cpu_parent
    return "outside"


def _innermost_stage(event) -> str:
    """The stage (StageClock label) around a profiler event, or "outside"."""
    return _innermost_range(event, (LABEL_PREFIX,))


def count_by_scope(events, names: tuple[str, ...]) -> dict[str, int]:
    """How many of the host's events called one of `names` ran inside each scope: the
    innermost named range around the event (a plugin stage, one of vLLM's own scopes when
    VLLM_CUSTOM_SCOPES_FOR_PROFILING=1, any other record_function range; "outside" if
    none). Says whose code waits on the device: the plugin's stages or vLLM's runner.
    events: the profiler's events (name, cpu_parent); a device's never match `names`."""
    counts: dict[str, int] = defaultdict(int)
    for event in events:
        if event.name in names:
            counts[_innermost_range(event, ("",))] += 1
    return dict(counts)


# 24 kernels a stage: with 12, a tree round's draft stage listed 1.10 of its 1.30 ms, the
# rest (the per-depth top M, the scorer's gathers) unnamed (H100, 2026-12-06h).
def kernels_by_stage(events, top: int = 24) -> tuple[dict[str, float], dict[str, list[dict]]]:
    """The GPU's kernels per stage: each kernel goes to the innermost stage range on the
    device's timeline that holds its start ("outside" if none). Copies and fills
    (`Memcpy ...`, `Memset ...`) run on copy engines beside the kernels, and other named
    ranges are no kernels: left out. Returns (milliseconds per stage, per stage its `top`
    kernels by GPU time: [{"kernel": name, "calls": n, "ms": total}], the largest first,
    which say what a stage's milliseconds are). events: the profiler's events (device
    ones have device_type CUDA, a time range in microseconds and is_user_annotation)."""
    ms: dict[str, float] = defaultdict(float)
    found: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    for stage, name, kernel_ms in _staged_kernels(events):
        ms[stage] += kernel_ms
        entry = found[stage][name]
        entry[0] += 1
        entry[1] += kernel_ms
    tops = {
        stage: [
            {"kernel": name, "calls": calls, "ms": total}
            for name, (calls, total) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]
        ]
        for stage, kernels in found.items()
    }
    return dict(ms), tops


def _staged_kernels(events):
    """(stage, kernel name, milliseconds) of every GPU kernel among the events: its stage
    the innermost stage range on the device's timeline that holds its start."""
    ranges, kernels = [], []
    for e in events:
        if e.device_type.name != "CUDA":
            continue
        span = (e.time_range.start, e.time_range.end)
        if e.name.startswith(LABEL_PREFIX):
            ranges.append((*span, e.name[len(LABEL_PREFIX) :]))
        # Other ranges on the device's timeline (vLLM's own scopes, such as "gpu_model_runner:
        # preprocess") are no kernels: counted as such, they doubled the H200's 2026-12-03
        # kernel ms per round (6.2 -> 12.9).
        elif not (e.is_user_annotation or e.name.startswith(("Memcpy", "Memset"))):
            kernels.append((*span, e.name))
    ranges.sort()
    starts = [r[0] for r in ranges]
    for start, end, name in kernels:
        # Ranges that begin at or before the kernel; the innermost holding it is the
        # shortest of those that end after its start.
        holding = [r for r in ranges[: bisect.bisect_right(starts, start)] if r[1] > start]
        stage = min(holding, key=lambda r: r[1] - r[0])[2] if holding else "outside"
        yield stage, name, (end - start) / 1e3
