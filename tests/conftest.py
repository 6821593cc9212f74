"""Shared fixtures: the toy target/drafter pair is written and loaded once per session."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from vllm_dominotree.demo.toy_pair import PairSpec, write_pair
from vllm_dominotree.drafter import Drafter
from vllm_dominotree.training.smollm2 import convert

# Noise at which the toy drafter's corrected top-1 is wrong often enough for trees to
# take sibling paths, yet right often enough for deep and whole-block acceptance.
SIBLING_NOISE = 0.8


def load_target(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def attentive_target(tmp_path_factory):
    """The toy pair's target with attention that matters (PairSpec.context): about a
    fifth of its greedy tokens depend on more than the last token, so a wrong mask,
    position or KV move changes the output. The toy drafters fit it."""
    root = tmp_path_factory.mktemp("attentive")
    target_dir, _ = write_pair(root, PairSpec(noise=0.0, context=1.4))
    return load_target(target_dir)


@pytest.fixture(scope="session")
def toy_pair(tmp_path_factory):
    """(target model, exact drafter, noisy drafter, PairSpec) on the same target."""
    root = tmp_path_factory.mktemp("pair")
    exact_spec = PairSpec(noise=0.0)
    target_dir, exact_dir = write_pair(root / "exact", exact_spec)
    _, noisy_dir = write_pair(root / "noisy", PairSpec(noise=SIBLING_NOISE))
    return load_target(target_dir), Drafter.load(exact_dir), Drafter.load(noisy_dir), exact_spec


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct converted from the packaged GGUF, once per session."""
    return convert(tmp_path_factory.mktemp("smollm2") / "target")
