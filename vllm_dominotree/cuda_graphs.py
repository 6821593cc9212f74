"""The plugin's CUDA graph captures, with Python's garbage collector off inside them.

A collection during a capture can free what an earlier builder, stage or engine of the
process left behind: its graph (whose reset CUDA refuses while a stream captures) or its
Triton kernels (whose modules are unloaded). Either ends the capture with
cudaErrorStreamCaptureInvalidated. It happened on an H100 (2026-12-07d): a device
builder's capture failed that way after 5 earlier tests' builders in one pytest process
(the log shows a CUDAGraph reset refused during the capture), and passed alone.
torch.cuda.graph collects once on entry; this keeps the collector off until the capture
has ended. vLLM turns it off around its own captures for the same reason
(vllm/utils/gc_utils.py, `freeze_gc_for_cudagraph_capture`); the tree builder also runs
without vLLM (benchmarks/builder_bench.py), hence a helper of its own.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def capture(graph: torch.cuda.CUDAGraph, pool: tuple | None = None) -> Iterator[None]:
    """`torch.cuda.graph(graph, pool=pool)` with no automatic garbage collection inside."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    finally:
        if collecting:
            gc.enable()
