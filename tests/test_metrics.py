"""The block of figures behind /metrics: written by one process, read by another, and
served in prometheus' text format and as vLLM's metric snapshot."""

from __future__ import annotations

import math
import subprocess
import sys

from prometheus_client import CollectorRegistry, generate_latest

from vllm_dominotree import metrics
from vllm_dominotree.metrics import BUCKETS, COUNTERS, MetricsBlock

WRITER = """
import sys
from vllm_dominotree.metrics import MetricsBlock
block = MetricsBlock(sys.argv[1])
block.add({"trees": 3, "accepted_tokens": 7})
block.add({"trees": 2})
block.observe("build_seconds", 0.0015)
block.observe("build_seconds", 0.3)
"""


def test_a_writer_process_is_seen_by_the_reader(tmp_path):
    block = MetricsBlock.create()
    try:
        subprocess.run([sys.executable, "-c", WRITER, block.path], check=True)
        counters = block.counters()
        assert counters["trees"] == 5 and counters["accepted_tokens"] == 7
        assert set(counters) == set(COUNTERS) and counters["kv_moves"] == 0
        buckets, total, count = block.histogram("build_seconds")
        assert count == 2 and math.isclose(total, 0.3015)
        # Cumulative: one observation at <= 0.002, both by 1.0 and +Inf.
        assert buckets[BUCKETS.index(0.002)] == 1 and buckets[BUCKETS.index(0.001)] == 0
        assert buckets[BUCKETS.index(1.0)] == 2 and buckets[-1] == 2
        assert block.histogram("draft_seconds")[2] == 0
    finally:
        block.remove()


def test_prometheus_text_and_snapshot():
    block = MetricsBlock.create()
    try:
        block.add({"sibling_accepts": 4})
        block.observe("draft_seconds", 0.004)
        registry = CollectorRegistry()
        collector = metrics._Collector()
        collector.block = block
        registry.register(collector)
        text = generate_latest(registry).decode()
        assert "dominotree_sibling_accepts_total 4.0" in text
        assert 'dominotree_draft_seconds_bucket{le="0.005"} 1.0' in text
        assert 'dominotree_draft_seconds_bucket{le="0.002"} 0.0' in text
        assert "dominotree_draft_seconds_count 1.0" in text
        by_name = {m.name: m for m in metrics.snapshot(block)}
        assert by_name["dominotree_sibling_accepts"].value == 4
        assert by_name["dominotree_draft_seconds"].count == 1
        assert by_name["dominotree_draft_seconds"].buckets["0.005"] == 1
    finally:
        block.remove()
