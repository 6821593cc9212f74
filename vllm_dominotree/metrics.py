"""The plugin's own figures for operators: `GET /metrics` and `LLM.get_metrics()`.

vLLM's spec-decode counters say how many drafts were verified and accepted; they cannot
say what a tree did (accepted non-first children, leaves, K/V moves) or what the trees
cost. Those figures are the tree runner's, in the worker, and none of vLLM 0.32's pipes
from a worker to the front end carries a plugin's figures. So:

- process 0 (the LLM or the API server) creates a small file-backed block of float64
  counters (`MetricsBlock`) when it builds a DominoTree engine's config, passes its path
  to the engine's processes in the environment (they are started after the config is
  built; not in `additional_config`, which vLLM hashes into its compile cache key), and
  registers one prometheus collector that reads the block at every scrape (vLLM's
  /metrics serves the same registry);
- the runner of the first rank (every tensor-parallel rank computes the same trees)
  adds each step's figures to the block, after the step's own host sync: no extra sync,
  no message.

Counters are cumulative from engine start (float64: exact to 2**53); the draft and build
seconds are histograms of each step's device time (CUDA events; on CPU the host's). With
several engines in one process /metrics reports the latest, and each engine's
`LLM.get_metrics()` its own. With vLLM's
`--api-server-count > 1` /metrics serves only prometheus' multiprocess files, which this
block is not: the figures are then only in `dominotree_stats` (collective_rpc).
"""

from __future__ import annotations

import atexit
import math
import os
import tempfile
from pathlib import Path

import numpy as np

PATH_VARIABLE = "DOMINOTREE_METRICS_FILE"  # the block's file, for the engine's processes
PREFIX = "dominotree_"

COUNTERS = {
    "steps": "verification steps with at least one draft tree",
    "trees": "draft trees verified",
    "tree_nodes": "drafted tree nodes verified (verification rows beside the roots)",
    "accepted_tokens": "drafted tokens accepted (the bonus token excluded)",
    "sibling_accepts": "accepted nodes that were not their parent's first child",
    "tree_leaves": "leaves of the trees verified (a chain has one)",
    "kv_moves": "accepted paths whose K/V moved to the first verification slots",
    "graph_builds": "tree builds that replayed a captured CUDA graph",
    "eager_builds": "tree builds that ran outside CUDA graphs (CPU, or an uncaptured size)",
    "graph_accepts": "verification steps whose acceptance and K/V move replayed a CUDA graph",
    "eager_accepts": "verification steps accepted outside CUDA graphs (sampled, CPU, eager)",
    "one_pass_steps": "verification steps whose target layers ran no stock attention (one pass)",
}
HISTOGRAMS = {
    "draft_seconds": "drafter backbone pass per step (device time)",
    "build_seconds": "drafter logits, scorer preparation and tree build per step (device time)",
}
BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0, math.inf)


def _layout() -> dict[str, slice]:
    """Slots of the block: one per counter; per histogram its bucket counts (not
    cumulative), then its sum, then its count."""
    slots, at = {}, 0
    for name in COUNTERS:
        slots[name] = slice(at, at + 1)
        at += 1
    for name in HISTOGRAMS:
        slots[name] = slice(at, at + len(BUCKETS) + 2)
        at += len(BUCKETS) + 2
    return slots


_SLOTS = _layout()
_SIZE = max(s.stop for s in _SLOTS.values())


class MetricsBlock:
    """The shared float64 block. One writer (the first rank's runner), any readers."""

    def __init__(self, path: str | Path, create: bool = False):
        self.path = str(path)
        self._values = np.memmap(
            self.path, dtype=np.float64, mode="w+" if create else "r+", shape=(_SIZE,)
        )

    @classmethod
    def create(cls) -> MetricsBlock:
        fd, path = tempfile.mkstemp(prefix="dominotree-metrics-", suffix=".f64")
        os.close(fd)
        return cls(path, create=True)  # zeros

    def add(self, counts: dict[str, int]) -> None:
        for name, value in counts.items():
            self._values[_SLOTS[name].start] += value

    def observe(self, name: str, seconds: float) -> None:
        slot = _SLOTS[name]
        bucket = next(i for i, bound in enumerate(BUCKETS) if seconds <= bound)
        self._values[slot.start + bucket] += 1
        self._values[slot.stop - 2] += seconds
        self._values[slot.stop - 1] += 1

    def counters(self) -> dict[str, float]:
        return {name: float(self._values[_SLOTS[name].start]) for name in COUNTERS}

    def histogram(self, name: str) -> tuple[list[float], float, float]:
        """(bucket counts, cumulative as prometheus wants them; sum; count)."""
        slot = self._values[_SLOTS[name]]
        return np.cumsum(slot[: len(BUCKETS)]).tolist(), float(slot[-2]), float(slot[-1])

    def remove(self) -> None:
        Path(self.path).unlink(missing_ok=True)


class _Collector:
    """Reads the current engine's block at scrape time."""

    def __init__(self):
        self.block: MetricsBlock | None = None

    def describe(self):
        return []  # the families are only known at collect time

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        if self.block is None:
            return
        for name, value in self.block.counters().items():
            yield CounterMetricFamily(f"{PREFIX}{name}", COUNTERS[name], value=value)
        for name, doc in HISTOGRAMS.items():
            buckets, total, _ = self.block.histogram(name)
            bounds = ["+Inf" if math.isinf(b) else repr(b) for b in BUCKETS]
            yield HistogramMetricFamily(
                f"{PREFIX}{name}",
                doc,
                buckets=list(zip(bounds, buckets, strict=True)),
                sum_value=total,
            )


_COLLECTOR = _Collector()
_ENGINES: list[tuple[object, MetricsBlock]] = []  # (engine config, its block), process 0


def export_for_engine() -> MetricsBlock:
    """Process 0, before a DominoTree engine's config is built: a fresh block for it, its
    path for the engine's processes, and the /metrics collector pointed at it."""
    from prometheus_client import REGISTRY

    if not _ENGINES and _COLLECTOR.block is None:
        REGISTRY.register(_COLLECTOR)
        atexit.register(_remove_all)
    block = MetricsBlock.create()
    os.environ[PATH_VARIABLE] = block.path
    _COLLECTOR.block = block
    _ENGINES.append((None, block))
    return block


def bind(config: object, block: MetricsBlock) -> None:
    """Remember which engine config the block belongs to (LLM.get_metrics of that
    engine reads it, even while a later engine is what /metrics shows)."""
    _ENGINES[:] = [(c, b) for c, b in _ENGINES if b is not block] + [(config, block)]


def block_of(config: object) -> MetricsBlock | None:
    return next((b for c, b in _ENGINES if c is config), None)


def _remove_all() -> None:
    for _, block in _ENGINES:
        block.remove()


def engine_block() -> MetricsBlock | None:
    """In an engine's process: the block process 0 made for this engine (None when the
    engine was not built through the plugin's config path)."""
    path = os.environ.get(PATH_VARIABLE)
    return MetricsBlock(path) if path and Path(path).is_file() else None


def snapshot(block: MetricsBlock) -> list:
    """The block's figures as vLLM's `LLM.get_metrics()` lists its own
    (vllm.v1.metrics.reader Counter / Histogram)."""
    from vllm.v1.metrics.reader import Counter, Histogram

    out: list = [
        Counter(name=f"{PREFIX}{name}", labels={}, value=int(value))
        for name, value in block.counters().items()
    ]
    for name in HISTOGRAMS:
        buckets, total, count = block.histogram(name)
        bounds = ["+Inf" if math.isinf(b) else repr(b) for b in BUCKETS]
        out.append(
            Histogram(
                name=f"{PREFIX}{name}",
                labels={},
                buckets={b: int(c) for b, c in zip(bounds, buckets, strict=True)},
                count=int(count),
                sum=total,
            )
        )
    return out
