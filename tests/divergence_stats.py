"""The bf16 divergence test's bars (tests/gpu/test_bf16_divergence.py): whether the plugin
leaves the target's output on significantly more prompts than vLLM's DFlash, and whether
each divergence is a flipped near-tie of the target's. Here so that CI checks them on
the CPU (test_divergence_stats.py)."""

from __future__ import annotations

from math import comb

# The first-divergence counts are small and vary from run to run: vLLM's DFlash alone gave
# 3, then 2 of the same 100 SmolLM2 prompts (H200, 2026-12-02 and -03; its V1 runner 3 and
# 3), as the batch's composition, and with it the kernels' splits, changes under
# asynchronous scheduling. "No worse" is therefore a test, not a count against a count.
SIGNIFICANCE = 0.05

# A divergence that rounding explains happens where the target itself nearly ties: its
# top token leads the runner-up by a hair, and the speculative output took the runner-up.
# A lead of a whole nat (e: 2.7x the runner-up's probability) is far beyond what bf16's
# rounding moves a logit; a divergence there means a wrong row, not a flipped tie.
NEAR_TIE = 1.0


def worse_p_value(plugin: int, dflash: int, prompts: int) -> float:
    """One-sided Fisher exact test: the chance that the plugin diverges on this many
    prompts or more if both methods diverge at one rate, i.e. if the two counts' sum were
    dealt at random between two sets of `prompts` prompts."""
    total = plugin + dflash
    tail = sum(comb(prompts, k) * comb(prompts, total - k) for k in range(plugin, total + 1))
    return tail / comb(2 * prompts, total)


def diverged(outputs: list[list[int]], target: dict, name: str) -> list[dict]:
    """Each prompt's first divergence from the target's own output (target: the
    baselines' "want" and "margins"), earliest first: where, the target's lead there of
    its top token over the runner-up, and whether the output took the runner-up."""
    found = []
    for prompt, (got, want, margins) in enumerate(
        zip(outputs, target["want"], target["margins"], strict=True)
    ):
        at = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        if at is not None:
            lead, runner_up = margins[at]
            taken = got[at] == runner_up
            found.append({"prompt": prompt, "at": at, "lead": lead, "runner_up": taken})
    found.sort(key=lambda d: d["at"])
    print(
        f"{name}: {len(found)} of {len(outputs)} prompts diverge (first divergence at "
        f"{[d['at'] for d in found]}; the target's lead there "
        f"{[round(d['lead'], 3) for d in found]}, the runner-up taken "
        f"{[d['runner_up'] for d in found]})"
    )
    return found


def not_near_ties(found: list[dict]) -> list[dict]:
    """The divergences that no flipped near-tie explains."""
    return [d for d in found if d["lead"] >= NEAR_TIE or not d["runner_up"]]


def top_two_margins(logprobs: list[dict]) -> list[tuple[float, int]]:
    """Per position of one output (vLLM's logprobs: token -> Logprob), the top token's
    log-prob lead over the runner-up, and the runner-up."""
    found = []
    for position in logprobs:  # the sampled token and the top two, ranked by log-prob
        ranked = sorted(position.items(), key=lambda kv: -kv[1].logprob)
        (_, top), (second, runner_up) = ranked[:2]
        found.append((top.logprob - runner_up.logprob, second))
    return found
