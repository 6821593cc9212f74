"""Where a DominoTree step's time goes, for benchmarks (off unless asked for).

`llm.collective_rpc("dominotree_profile", args=(True,))` turns it on; the seconds per
stage then come back in `dominotree_stats`. Every stage is bracketed by device
synchronizations, so the stages add up to the step, but the syncs make the step
itself slower: measure a round's cost with the clock off and its split with it on.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# execute_model (target forward = verify), sample_tokens (accept), propose (draft =
# the drafter's backbone pass and logits, build = the trees).
STAGES = ("step", "verify", "accept", "draft", "build")


class StageClock:
    def __init__(self, device: torch.device):
        self.device = device
        self.enabled = False
        self.seconds: dict[str, float] = defaultdict(float)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
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
