"""The bf16 divergence test's bar (tests/gpu/test_bf16_divergence.py): whether the plugin
leaves the target's output on significantly more prompts than vLLM's DFlash. Here so
that CI checks it on the CPU (test_divergence_stats.py)."""

from __future__ import annotations

from math import comb

# The first-divergence counts are small and vary from run to run: vLLM's DFlash alone gave
# 3, then 2 of the same 100 SmolLM2 prompts (H200, 2026-12-02 and -03; its V1 runner 3 and
# 3), as the batch's composition, and with it the kernels' splits, changes under
# asynchronous scheduling. "No worse" is therefore a test, not a count against a count.
SIGNIFICANCE = 0.05


def worse_p_value(plugin: int, dflash: int, prompts: int) -> float:
    """One-sided Fisher exact test: the chance that the plugin diverges on this many
    prompts or more if both methods diverge at one rate, i.e. if the two counts' sum were
    dealt at random between two sets of `prompts` prompts."""
    total = plugin + dflash
    tail = sum(comb(prompts, k) * comb(prompts, total - k) for k in range(plugin, total + 1))
    return tail / comb(2 * prompts, total)
