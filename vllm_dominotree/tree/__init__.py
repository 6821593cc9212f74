"""Draft trees: the best-first builder, its scorers, and lossless acceptance (torch only)."""

from .acceptance import SamplingParams, accept, draw_target_tokens, target_probs
from .builder import Children, DraftTree, Expansion, TreeShape, build_trees
from .device_builder import DeviceTreeBuilder
from .scorers import ConditionalScorer, MarginalScorer, make_scorer

__all__ = [
    "Children",
    "ConditionalScorer",
    "DeviceTreeBuilder",
    "DraftTree",
    "Expansion",
    "MarginalScorer",
    "SamplingParams",
    "TreeShape",
    "accept",
    "build_trees",
    "draw_target_tokens",
    "make_scorer",
    "target_probs",
]
