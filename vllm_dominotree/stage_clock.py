"""Seconds per stage of a decoding step, for benchmarks (off unless asked for).

Used by the engine's runner (`llm.collective_rpc("dominotree_profile", args=(True,))`
turns it on; the seconds per stage come back in `dominotree_stats`) and by the reference
decoder. Every stage is bracketed by device synchronizations, so stages add up inside
the step, but the syncs make the step itself slower: measure a round's cost with the
clock off and its split with it on. Stages may nest (a step holds its stages).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch

LABEL_PREFIX = "dominotree."


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
        elif self.enabled:
            with self._timed(name):
                yield
        else:  # the hot path: neither timing nor tracing
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


class DraftBuildTimes:
    """The device seconds of one step's draft and build, measured without a sync of
    their own: CUDA events at the stage boundaries, read after the build has waited for
    its trees anyway (on CPU, where the work runs synchronously, the host's clock)."""

    DRAFT, DRAFTED, BUILT = 0, 1, 2

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if self.cuda else []
        self._times = [0.0, 0.0, 0.0]

    def mark(self, point: int) -> None:
        if self.cuda:
            self._events[point].record()
        else:
            self._times[point] = time.perf_counter()

    def seconds(self) -> tuple[float, float]:
        """(draft, build) of the last marked step; call once BUILT has completed."""
        if self.cuda:
            start, drafted, built = self._events
            return start.elapsed_time(drafted) / 1e3, drafted.elapsed_time(built) / 1e3
        start, drafted, built = self._times
        return drafted - start, built - drafted
