"""Seconds per stage of a decoding step, for benchmarks (off unless asked for).

Used by the engine's runner (`llm.collective_rpc("dominotree_profile", args=(True,))`
turns it on; the seconds per stage come back in `dominotree_stats`) and by the reference
decoder. Every stage is bracketed by device synchronizations, so stages add up inside
the step, but the syncs make the step itself slower: measure a round's cost with the
clock off and its split with it on. Stages may nest (a step holds its stages).
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
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
    """The device seconds of each step's draft and build, measured without a sync of
    their own: CUDA events at the stage boundaries, read once the GPU has passed them
    (`ready`), a step or so later under asynchronous scheduling (on CPU, where the work
    runs synchronously, the host's clock, ready at once)."""

    DRAFT, DRAFTED, BUILT = 0, 1, 2

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._free: list[list] = []  # event triples to reuse
        self._pending: deque[list] = deque()  # closed steps, oldest first
        self._marks = self._new()

    def _new(self) -> list:
        if not self.cuda:
            return [0.0, 0.0, 0.0]
        if self._free:
            return self._free.pop()
        return [torch.cuda.Event(enable_timing=True) for _ in range(3)]

    def mark(self, point: int) -> None:
        if self.cuda:
            self._marks[point].record()
        else:
            self._marks[point] = time.perf_counter()

    def close(self) -> None:
        """The step's marks are all set."""
        self._pending.append(self._marks)
        self._marks = self._new()

    def ready(self) -> list[tuple[float, float]]:
        """(draft, build) seconds of the closed steps the device has finished, oldest
        first; each is returned once."""
        out = []
        while self._pending and (not self.cuda or self._pending[0][self.BUILT].query()):
            start, drafted, built = marks = self._pending.popleft()
            if self.cuda:
                out.append((start.elapsed_time(drafted) / 1e3, drafted.elapsed_time(built) / 1e3))
                self._free.append(marks)
            else:
                out.append((drafted - start, built - drafted))
        return out
