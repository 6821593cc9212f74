"""Lossless acceptance of a verified draft tree: sample-and-match.

The target has produced logits for every node of the tree (row i: the distribution of
the token after node i's path). At each node the target's own token is drawn from
that row, with the request's temperature / top-k / top-p and generator (greedy: argmax).
The walk starts at the root and descends into the child holding the drawn token; where
no child holds it, the drawn token is emitted as the bonus and the round ends.

Why this is lossless: every emitted token is the target's draw given exactly the tokens
before it, and the draws at different nodes are independent; the drafts only decide how
many of those draws one target pass can check. No draft probabilities are needed, so it
holds for any tree and any scorer, and a duplicate sibling token only means two children
that the walk could enter, of which it takes the first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .builder import ROOT, DraftTree


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 or >= V: off
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(
                f"bad sampling params {self}: need temperature >= 0, top_k >= 0, 0 < top_p <= 1"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        if self.seed is None:
            return None
        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed)
        return gen


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the target samples from: logits [n, V] -> probs [n, V] after
    temperature, top-k, then top-p (vLLM's order)."""
    scores = logits.float() / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = scores.topk(params.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draw_target_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> torch.Tensor:
    """One target token per row. logits: [n, V] -> [n] long."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = target_probs(logits, params)
    # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p.
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def accept(tree: DraftTree, target_tokens: list[int]) -> tuple[list[int], int]:
    """Walk the tree with the target's token at every node (target_tokens[i] for node i).
    Returns the accepted nodes (root excluded, root to leaf) and the bonus token."""
    node, path = ROOT, []
    while True:
        token = target_tokens[node]
        child = next((c for c in tree.children[node] if tree.tokens[c] == token), None)
        if child is None:
            return path, token
        path.append(child)
        node = child


def sibling_accepts(tree: DraftTree, path: list[int]) -> int:
    """Accepted nodes that were not their parent's first child: the branches a chain
    could not have taken (the engine counts them on the device from sibling bits)."""
    return sum(tree.children[tree.parents[n]][0] != n for n in path)
