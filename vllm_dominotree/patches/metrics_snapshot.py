"""Patch: `LLM.get_metrics()` lists the plugin's figures beside vLLM's own.

Why: vLLM 0.32's `get_metrics_snapshot()` keeps only the registry's families whose names
start with "vllm:"; the plugin's (metrics.py) start with "dominotree_". /metrics needs
no patch: it serves the whole registry.
How: `LLMEngine.get_metrics` is wrapped; for a DominoTree engine its list gains the
plugin's counters and histograms, as vLLM's reader types (Counter, Histogram).
Related upstream work: none known (the reader's prefix filter is hard-coded).
Removal: when vLLM's reader lists every family of the registry, or takes plugin prefixes.
"""

from __future__ import annotations

import functools

from vllm.v1.engine.llm_engine import LLMEngine

from ..metrics import block_of, snapshot


def patch_metrics_snapshot() -> None:
    original = LLMEngine.get_metrics
    if getattr(original, "_dominotree", False):
        return

    @functools.wraps(original)
    def get_metrics(self):
        metrics = original(self)
        block = block_of(self.vllm_config)  # None: not a DominoTree engine
        return metrics if block is None else [*metrics, *snapshot(block)]

    get_metrics._dominotree = True
    LLMEngine.get_metrics = get_metrics
