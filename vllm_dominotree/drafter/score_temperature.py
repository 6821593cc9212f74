"""A drafter's score temperatures: how much flatter its distributions are read when they
shape a tree.

A best-first tree holds the nodes of highest path probability; the tokens it accepts on
average are the sum over its nodes of the probability that the target agrees with the
whole path. So the tree is best when the drafter's probabilities are the target's
agreement rates. A drafter trained for minutes is overconfident: the shipped SmolLM2
drafter's corrected top candidate carries 0.56-0.61 of the probability where the target
agrees 37-45% of the time, at every depth (teacher-forced on its target's answers,
benchmarks/results/cpu_2026-12-07g_score_temperature/). Dividing its logits by T before
the tree's softmax (temperature scaling, Guo et al. 2017) fixes the level; T is fitted
by the likelihood of the target's tokens on answers the drafter was not trained on
(training/calibrate.py). Output stays lossless: acceptance never reads draft
probabilities (tree/acceptance.py), T only decides which nodes a tree holds.

A drafter ships its temperatures beside its weights in `score_temperature.json`:
`{"temperatures": {"conditional": T, "marginal": T}, "fit": {...how...}}`; a scorer
without an entry, and a drafter without the file, read T = 1.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .checkpoint import DrafterFormatError

TEMPERATURE_FILE = "score_temperature.json"
# The scorers whose trees a temperature shapes (the chain's argmax path does not move).
TREE_SCORERS = ("conditional", "marginal")


def temperature_path(drafter_dir: str | Path) -> Path:
    return Path(drafter_dir) / TEMPERATURE_FILE


def check_temperature(value, what: str) -> float:
    """A temperature as a float: a finite number > 0 (else a ValueError naming `what`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number > 0, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{what} must be a finite number > 0, got {value!r}")
    return float(value)


def read_temperatures(drafter_dir: str | Path) -> dict[str, float]:
    """The drafter's fitted temperatures by scorer ({} without the file), checked."""
    path = temperature_path(drafter_dir)
    if not path.is_file():
        return {}
    try:
        temperatures = json.loads(path.read_text())["temperatures"]
        if not isinstance(temperatures, dict):
            raise TypeError("'temperatures' is not an object")
        unknown = sorted(set(temperatures) - set(TREE_SCORERS))
        if unknown:
            raise ValueError(f"unknown scorers {unknown}; known: {list(TREE_SCORERS)}")
        return {
            scorer: check_temperature(value, f"the {scorer} temperature")
            for scorer, value in temperatures.items()
        }
    except (ValueError, TypeError, KeyError) as err:
        raise DrafterFormatError(
            f"{path} is malformed ({err}); write it again with `python -m "
            "vllm_dominotree.training.calibrate`, or delete it (temperature 1)"
        ) from err


def default_temperature(drafter_dir: str | Path, scorer: str) -> float:
    """The temperature a scorer takes when the user names none: the drafter's fitted one,
    else 1."""
    return read_temperatures(drafter_dir).get(scorer, 1.0)


def write_temperatures(drafter_dir: str | Path, temperatures: dict[str, float], fit: dict) -> Path:
    path = temperature_path(drafter_dir)
    for scorer, value in temperatures.items():
        check_temperature(value, f"the {scorer} temperature")
    path.write_text(json.dumps({"temperatures": temperatures, "fit": fit}, indent=1) + "\n")
    return path
