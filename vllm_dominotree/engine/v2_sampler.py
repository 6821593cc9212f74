"""The sampling law of a V2 step's requests, as tree acceptance reads it.

`acceptance.draw_targets` reads V1's `SamplingMetadata` (per batch row: temperature,
top-k, top-p; the seeded requests' generators). vLLM's V2 runner keeps the same per
request-state slot (`sampler.sampling_states`, host arrays and device tensors) and
re-sorts the batch every step, so the law is gathered by `input_batch.idx_mapping`.
A seeded request's tree rows draw keyed noise (acceptance.keyed_exponential) from its
seed, as on V1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Seed:
    """A seeded request's generator, as draw_targets reads it."""

    seed: int

    def initial_seed(self) -> int:
        return self.seed % 2**64


@dataclass(frozen=True)
class StepLaw:
    """The fields of V1's SamplingMetadata that draw_targets reads, per batch row."""

    all_greedy: bool
    temperature: torch.Tensor  # [R]
    top_k: torch.Tensor | None  # [R], None: no request restricts
    top_p: torch.Tensor | None
    generators: dict[int, Seed]  # batch row -> seed


def step_law(states, input_batch) -> StepLaw:
    """states: the V2 sampler's `sampling_states`; the law of the batch's requests."""
    n = input_batch.num_reqs
    slots, slots_np = input_batch.idx_mapping[:n], input_batch.idx_mapping_np[:n]
    top_k = states.top_k.np[slots_np] != states.vocab_size
    top_p = states.top_p.np[slots_np] != 1.0
    return StepLaw(
        all_greedy=bool((states.temperature.np[slots_np] == 0.0).all()),
        temperature=states.temperature.gpu[slots],
        top_k=states.top_k.gpu[slots] if top_k.any() else None,
        top_p=states.top_p.gpu[slots] if top_p.any() else None,
        generators={
            row: Seed(int(states.seeds.np[slot]))
            for row, slot in enumerate(slots_np.tolist())
            if states.seeds_set[slot]
        },
    )


class TreeRejectionSampler:
    """In place of vLLM's V2 rejection sampler (`runner.rejection_sampler`, called for
    steps with drafts): the runner's tree acceptance."""

    def __init__(self, accept):
        self.accept = accept  # (logits, input_batch) -> SamplerOutput

    def __call__(self, logits, input_batch, draft_logits=None, invalid_drafts=None):
        if invalid_drafts is not None:
            raise NotImplementedError("dominotree: structured outputs are not supported")
        return self.accept(logits, input_batch)
