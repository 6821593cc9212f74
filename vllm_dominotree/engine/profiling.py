"""Where a DominoTree step's time goes, for benchmarks (off unless asked for).

StageClock: `llm.collective_rpc("dominotree_profile", args=(True,))` turns it on; the
seconds per stage then come back in `dominotree_stats`. Every stage is bracketed by
device synchronizations, so the stages add up to the step, but the syncs make the step
itself slower: measure a round's cost with the clock off and its split with it on.

LaunchTrace: `llm.collective_rpc("dominotree_trace", args=(True,))`, run requests, then
`args=(False,)` returns what the worker's host asked of the GPU meanwhile (torch's
profiler over CUDA's runtime and driver API): CUDA graph replays, kernels launched
outside graphs, calls that block the host until the device catches up, and the host's
milliseconds inside each stage (the stages are profiler ranges while tracing).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class StageClock:
    def __init__(self, device: torch.device):
        self.device = device
        self.enabled = False
        # While a LaunchTrace runs, every stage is also a profiler range
        # ("dominotree.<stage>"), so the trace tells the host's time per stage (no syncs).
        self.labels = False
        self.seconds: dict[str, float] = defaultdict(float)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if self.labels:
            with torch.profiler.record_function(f"{LABEL_PREFIX}{name}"), self._timed(name):
                yield
        else:
            with self._timed(name):
                yield

    @contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[name] += time.perf_counter() - start

    def reset(self, enabled: bool) -> None:
        self.enabled = enabled
        self.seconds = defaultdict(float)


LABEL_PREFIX = "dominotree."

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
        for event in profiler.events():
            if event.name.startswith(("cuda", "cu")) and event.device_type.name == "CPU":
                calls[event.name] += 1

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

        return {
            "graph_launches": total(GRAPH_LAUNCHES),
            "kernel_launches": total(KERNEL_LAUNCHES),
            "host_waits": total(HOST_WAITS),
            "memcpy_async": calls.get("cudaMemcpyAsync", 0),
            "host_ms": dict(host_ms),
            "calls": dict(calls),
            "host_ops": averages.table(sort_by="self_cpu_time_total", row_limit=40),
            "kernels": averages.table(sort_by="self_cuda_time_total", row_limit=40),
        }
