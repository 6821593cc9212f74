"""The tree verification's counters: what tests, benchmarks and /metrics read.

Both runners (runner.py on vLLM's V1, v2_runner.py on its V2) count each step's trees on
the host and its accepted tokens, sibling accepts, K/V moves and leaves on the device
(acceptance.step_counters); `StepCounts` brings the device's figures to the host without
a wait, and `fold_steps` adds the landed steps to the totals.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from .tree_step import TreeStep


@dataclass
class DominoTreeStats:
    """Counters the tests and benchmarks read through collective_rpc."""

    steps: int = 0  # verification steps with at least one tree
    trees: int = 0  # trees verified
    tree_nodes: int = 0  # drafted nodes verified (the verification rows beside the roots)
    accepted_tokens: int = 0  # drafted tokens accepted (bonus excluded)
    sibling_accepts: int = 0  # accepted nodes that were not their parent's first child
    kv_moves: int = 0  # accepted paths whose K/V had to move to the first slots
    tree_leaves: int = 0  # leaves of the trees verified (a chain has one)
    # Verification steps by how vLLM ran the target's forward: one FULL CUDA graph,
    # piecewise graphs (attention eager between them; mixed batches), or eagerly.
    full_graph_steps: int = 0
    piecewise_steps: int = 0
    eager_steps: int = 0
    # Tree builds by how they ran: one captured CUDA graph, or eagerly (CPU; on CUDA a
    # batch size without a graph).
    graph_builds: int = 0
    eager_builds: int = 0
    # Builds that began with the drafter's logits and the scorer's preparation (inside
    # the build's graph on CUDA; one GPU, batches up to the proposer's byte bound).
    prepared_in_build: int = 0
    # Verification steps by how the accept stage ran: one captured CUDA graph (greedy
    # steps on CUDA), or eagerly (sampled requests, CPU, no graphs captured).
    graph_accepts: int = 0
    eager_accepts: int = 0
    # Verification steps by how the trees' fields reached the step description: one
    # replay of a captured gather (CUDA), or eager gathers (CPU, eager engines).
    graph_descriptions: int = 0
    eager_descriptions: int = 0
    # Drafting steps by how the drafter's query pass ran: one replay of the plugin's
    # captured graph (CUDA, TP=1), or vLLM's own pass (piecewise graphs; CPU: eager).
    graph_drafts: int = 0
    eager_drafts: int = 0
    # How the target's attention computed the tree rows (config.attention_mode):
    # "one-pass" / "paths" (FA3 over path requests), "one-pass-fixup" / "fixup" (the
    # Triton tree kernel) or "cpu".
    tree_attention: str = ""
    # How the scorer computes a node's children (tree/scorers.py): "torch" (the compiled
    # torch step), "triton" (two launches per pop, not yet the default) or "table"
    # (marginal: per-depth tables).
    scorer_step: str = ""
    # How a step's trees are accepted (config.accept_kernel): "torch", "triton".
    accept_kernel: str = ""
    # Tokens the drafter's logits cover (its draft vocabulary, drafter/draft_vocab.py);
    # 0: the whole vocabulary.
    draft_vocab: int = 0
    # The trees' scores are the drafter's log-probs of logits / this (config
    # `score_temperature`: the drafter's fitted value unless the user named one).
    score_temperature: float = 1.0
    # Candidates per depth the conditional scorer or Domino's chain corrects: M (config
    # `candidates`), or the logits' width without a restriction; 0: the marginal scorer.
    candidates: int = 0
    # Nodes a request drafts per round (its verification checks budget + 1 rows): the
    # tree's budget, the chain's length (config.tree_shape).
    budget: int = 0
    # The trees' leaf limit (config `max_leaves`; 0: none).
    max_leaves: int = 0
    # The leaves a step's trees share (config `step_leaves`; 0: none).
    step_leaves: int = 0
    # The nodes a step's trees share (config `step_nodes`; 0: none).
    step_nodes: int = 0
    # FA3's key splits for the path requests (config.path_splits): "vllm" or a count.
    path_splits: str = ""
    # "fixup": how its rows round (cuda_attention.fixup_rounding): "fa3", "triton", "fast".
    fixup_rounding: str = ""
    # One pass: steps whose rows were all recomputed (all trees: no stock pass); the
    # other verification steps ran the stock pass and recomputed the fixed rows.
    one_pass_steps: int = 0
    # "one-pass": steps of budget + 1 rows per request with a request that is no tree
    # (a prefill chunk of that length), which vLLM would run in a FULL graph: run
    # piecewise instead (runner._determine_batch_execution_and_padding).
    split_uniform_steps: int = 0

    @property
    def mean_accept_length(self) -> float:
        return 1 + self.accepted_tokens / max(1, self.trees)

    @property
    def mean_leaves(self) -> float:
        return self.tree_leaves / max(1, self.trees)


class StepCounts:
    """Each step's device counters (acceptance.step_counters) copied to pinned host memory
    without a wait, and read with the step's host figures once the copy has landed."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._free: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        self._pending: deque[tuple[torch.Tensor, torch.cuda.Event | None, DominoTreeStats]] = (
            deque()
        )

    def push(self, counters: torch.Tensor, step: TreeStep) -> None:
        """A step's device counters [4] (queued, no wait) and its trees as the host knows
        them."""
        host = DominoTreeStats(
            steps=int(bool(step.trees)),
            trees=len(step.trees),
            tree_nodes=sum(t.num_rows - 1 for t in step.trees),
        )
        if self._free:
            copy, event = self._free.pop()
        else:
            copy = torch.zeros(4, dtype=torch.long, pin_memory=self.cuda)
            event = torch.cuda.Event() if self.cuda else None
        copy.copy_(counters, non_blocking=True)
        if event is not None:
            event.record()
        self._pending.append((copy, event, host))

    def landed(self, wait: bool) -> list[tuple[DominoTreeStats, list[int]]]:
        """The steps whose counters are on the host (all of them with `wait`), in order."""
        out = []
        while self._pending:
            copy, event, host = self._pending[0]
            if event is not None:
                if wait:
                    event.synchronize()
                elif not event.query():
                    break
            self._pending.popleft()
            out.append((host, copy.tolist()))
            self._free.append((copy, event))
        return out


def fold_steps(stats: DominoTreeStats, counts: StepCounts, wait: bool) -> None:
    """The landed steps' figures (all of them with `wait`) into the totals."""
    for step, (accepted, siblings, moves, leaves) in counts.landed(wait):
        stats.steps += step.steps
        stats.trees += step.trees
        stats.tree_nodes += step.tree_nodes
        stats.tree_leaves += leaves
        stats.accepted_tokens += accepted
        stats.sibling_accepts += siblings
        stats.kv_moves += moves
