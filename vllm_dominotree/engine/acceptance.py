"""Tree acceptance for a whole step on the device: no host round trip, no per-node loop.

Sample-and-match (tree/acceptance.py has the argument for why it is lossless): the
target's token is drawn at every logits row with the request's own temperature / top-k /
top-p (greedy: argmax; a seeded request's noise is keyed by its seed and the position),
a row is accepted iff every row on its path (its
ancestors-or-self bits, tree_step.py) holds the token drawn at its parent, and the bonus
is the token drawn at the deepest accepted row (the root if none). A sibling whose token
an earlier sibling already holds is never entered (the host walk takes the first child).

The result is in vLLM's rejection-sampler layout ([R, max_spec_len + 1]: the path's
tokens, the bonus, then -1) so that the scheduler's prefix rollback stays right; the
path's row offsets go to the commit (commit.py). vLLM copies the sampled ids to the host
once per step, as for its own sampler; the step's counters travel beside them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.outputs import LogprobsTensors
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
from vllm.v1.sample.sampler import Sampler

from .tree_step import TreeStep

_SAMPLING_EPS = 1e-5  # vLLM's own threshold for "temperature 0 means greedy"


@dataclass
class Accepted:
    sampled: torch.Tensor  # [R, W] int32: path tokens, the bonus, -1 after (W = width)
    path_offsets: torch.Tensor  # [R, W] long: row offsets of the path's nodes, -1 after
    num_accepted: torch.Tensor  # [R] long: drafted tokens accepted (bonus excluded)
    accepted: torch.Tensor  # [L] bool: logits rows on an accepted path


def draw_targets(
    logits: torch.Tensor,  # [L, V]
    row_requests: torch.Tensor,  # [L] long: the request of each row
    row_ranges: list[tuple[int, int]],  # per request, its logits rows [first, end)
    row_positions: torch.Tensor,  # [L] long: the position of the token each row draws
    sampling_metadata,
    min_p: torch.Tensor | None = None,  # [L]: each row's min_p (sampling_constraints.py)
) -> torch.Tensor:
    """The target's token at every logits row, [L] long: greedy, or drawn after the
    temperature, min_p, top-k and top-p (vLLM's order)."""
    # The first maximal logit, as vLLM's sampler's argmax over float32 logits takes; max()
    # rather than argmax(), whose CPU kernel over bfloat16 took 481 us for a step's 5 x
    # 49,152 logits where max() took 85 (2-core AMD EPYC, AVX-512 BF16, 2026-12-07).
    greedy = logits.max(dim=-1).indices
    if sampling_metadata.all_greedy:
        return greedy
    temperature = sampling_metadata.temperature[row_requests]
    scaled = logits.float() / torch.where(temperature < _SAMPLING_EPS, 1.0, temperature)[:, None]
    if min_p is not None:  # tokens less likely than min_p x the likeliest one are out
        probs = scaled.softmax(dim=-1)
        scaled.masked_fill_(
            probs < probs.amax(dim=-1, keepdim=True) * min_p[:, None], float("-inf")
        )

    def per_row(values):
        return None if values is None else values[row_requests]

    scaled = apply_top_k_top_p(
        scaled, per_row(sampling_metadata.top_k), per_row(sampling_metadata.top_p)
    )
    probs = scaled.softmax(dim=-1)
    # Exponential race: argmax(p / E), E ~ Exp(1), is a draw from p.
    noise = torch.empty_like(probs)
    generators = sampling_metadata.generators
    if len(generators) < len(row_ranges):
        noise.exponential_()
    if generators:
        # A seeded request's noise is a function of (seed, position, token) alone, not a
        # stream: the token it emits at a position does not depend on how many tree rows
        # earlier steps verified, so a seed reproduces across batchings, preemptions and
        # tensor-parallel layouts. Every position gets fresh noise, so each draw is still
        # the target's law given the path (tree/acceptance.py).
        rows = torch.cat([torch.arange(*row_ranges[r], device=logits.device) for r in generators])
        seeds = torch.cat(
            [
                torch.full((row_ranges[r][1] - row_ranges[r][0],), _as_int64(g.initial_seed()))
                for r, g in generators.items()
            ]
        ).to(logits.device)
        noise[rows] = keyed_exponential(seeds, row_positions[rows], probs.shape[-1])
    drawn = (probs / noise).argmax(dim=-1)
    return torch.where(temperature < _SAMPLING_EPS, greedy, drawn)


# splitmix64's constants as signed int64 (torch's integer arithmetic wraps).
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


def _as_int64(seed: int) -> int:
    """A generator's seed (0 .. 2**64 - 1) as the int64 with the same bits."""
    return seed - 2**64 if seed >= 2**63 else seed


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's >> is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def splitmix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64: a bijection of int64 whose outputs look independent."""
    z = z + _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def keyed_exponential(
    seeds: torch.Tensor,  # [n] long
    positions: torch.Tensor,  # [n] long
    vocab: int,
    chunk_elements: int = 1 << 24,
) -> torch.Tensor:
    """[n, vocab] float32 Exp(1) noise, each entry a function of (seed, position, token)
    alone (counter-based, no generator state). Rows in chunks of at most
    `chunk_elements` entries, to bound the int64 temporaries."""
    keys = splitmix(splitmix(seeds) ^ positions)  # [n]
    tokens = torch.arange(vocab, device=seeds.device)
    out = torch.empty(seeds.shape[0], vocab, device=seeds.device)
    step = max(1, chunk_elements // vocab)
    for start in range(0, seeds.shape[0], step):
        z = splitmix(keys[start : start + step, None] ^ tokens[None, :])
        uniform = (_shift_right(z, 11).double() + 0.5) * 2.0**-53  # (0, 1)
        out[start : start + step] = -torch.log(uniform)
    return out


def _request_bits(step: TreeStep, rows: torch.Tensor, num_reqs: int) -> torch.Tensor:
    """[R] int64: OR (= sum, the bits are disjoint) of the own bits of the rows set in
    `rows` ([L] bool), per request."""
    shift = (step.offset - 1).clamp(min=0)
    own = torch.where(step.offset >= 1, torch.ones_like(shift) << shift, 0)
    bits = torch.zeros(num_reqs, dtype=torch.int64, device=rows.device)
    return bits.index_add_(0, step.request, torch.where(rows, own, 0))


def accept_trees(
    step: TreeStep,
    target: torch.Tensor,  # [L] long: the target's token at every logits row
    last_rows: torch.Tensor,  # [R] long: each request's last logits row
    num_reqs: int,
    width: int,  # W = max_spec_len + 1
) -> Accepted:
    device = target.device
    match = (step.parent_row >= 0) & (step.token == target[step.parent_row.clamp(min=0)])
    matched = _request_bits(step, match, num_reqs)[step.request]
    first_match = match & ((matched & step.siblings_before) == 0)
    good = _request_bits(step, first_match, num_reqs)[step.request]
    tree_row = step.in_tree.bool()
    accepted = tree_row & (step.offset >= 1) & ((good & step.ancestors) == step.ancestors)

    rows = torch.arange(step.num_logits, device=device)
    # The deepest accepted row of each tree (its root if none); the last row otherwise.
    # Index num_reqs is a spare slot that rows of no interest write to.
    stop = torch.cat([last_rows, last_rows.new_zeros(1)])
    root = tree_row & (step.offset == 0)
    stop[torch.where(root, step.request, num_reqs)] = rows
    stop = stop.scatter_reduce(0, torch.where(accepted, step.request, num_reqs), rows, "amax")
    stop = stop[:num_reqs]
    num_accepted = torch.zeros(num_reqs, dtype=torch.long, device=device)
    num_accepted.index_add_(0, step.request, accepted.long())

    # Scatter the accepted rows to [request, depth - 1]; other rows go to a spare slot.
    flat = torch.where(accepted, step.request * width + step.depth - 1, num_reqs * width)
    sampled = torch.full((num_reqs * width + 1,), -1, dtype=torch.int32, device=device)
    sampled[flat] = step.token.to(torch.int32)
    path = torch.full((num_reqs * width + 1,), -1, dtype=torch.long, device=device)
    path[flat] = step.offset
    sampled = sampled[:-1].view(num_reqs, width)
    sampled.scatter_(1, num_accepted[:, None], target[stop].to(torch.int32)[:, None])
    return Accepted(sampled, path[:-1].view(num_reqs, width), num_accepted, accepted)


def accepted_logprobs(
    logits: torch.Tensor,  # [L, V] the step's raw logits rows
    accepted: Accepted,
    last_rows: torch.Tensor,  # [R] long: each request's last logits row
    num_logprobs: int,
    as_logits: bool = False,
) -> LogprobsTensors:
    """The logprobs vLLM reports for the step's tokens (raw: before temperature and
    top-k/top-p, vLLM's default `logprobs_mode`; as_logits: the raw logits), in its
    rejection sampler's layout: a row per entry of `accepted.sampled` ([R * W]) with the
    num_logprobs best tokens and the sampled one; vLLM drops the entries after the bonus.
    Token j of a request is drawn at the row of its path's node j: the root for j = 0,
    for j >= 1 the accepted node of depth j."""
    num_reqs, width = accepted.sampled.shape
    first = torch.cat([last_rows.new_zeros(1), last_rows[: num_reqs - 1] + 1])  # [R]
    drawn_at = torch.cat(
        [accepted.path_offsets.new_zeros(num_reqs, 1), accepted.path_offsets[:, : width - 1]], 1
    ).clamp(min=0)  # [R, W] offsets from the root; past the bonus the root (dropped)
    rows = (first[:, None] + drawn_at).flatten()
    values = logits[rows].float()
    if not as_logits:
        values = Sampler.compute_logprobs(values)
    tokens = accepted.sampled.flatten().clamp(min=0).long()
    return Sampler.gather_logprobs(values, num_logprobs, tokens)


def accept_step(
    step: TreeStep,
    target: torch.Tensor,  # [>= L] long
    last_rows: torch.Tensor,  # [R] long
    num_reqs: int,
    width: int,
    fused: bool = False,
) -> tuple[Accepted, torch.Tensor]:
    """accept_trees and step_counters: as written here, or with `fused` (CUDA,
    config.accept_kernel) in one Triton launch, one program per request
    (kernels/tree_accept.py, which these torch functions are the reference of)."""
    if not fused:
        accepted = accept_trees(step, target, last_rows, num_reqs, width)
        return accepted, step_counters(step, accepted)
    from ..kernels.tree_accept import accept_requests

    fields = (step.parent_row, step.token, step.ancestors, step.siblings_before)
    fields += (step.offset, step.depth, step.in_tree)
    sampled, path, num_accepted, accepted, counters = accept_requests(
        *fields, target, last_rows[:num_reqs], width
    )
    return Accepted(sampled, path, num_accepted, accepted), counters


def step_counters(step: TreeStep, accepted: Accepted) -> torch.Tensor:
    """[4] long: drafted tokens accepted, accepted nodes that are not their parent's first
    child, paths that are not rows 1..k (their K/V moves), and the leaves of the verified
    trees (a chain has one; counted here because only the device knows the trees)."""
    rows = accepted.accepted
    sibling = rows & (step.siblings_before != 0)
    off_place = torch.zeros_like(accepted.num_accepted)
    off_place.index_add_(0, step.request, (rows & (step.offset != step.depth)).long())
    tree_row = step.in_tree.bool()
    has_parent = tree_row & (step.parent_row >= 0)
    children = torch.zeros(step.num_logits + 1, dtype=torch.long, device=rows.device)
    children.index_add_(
        0, torch.where(has_parent, step.parent_row, step.num_logits), torch.ones_like(rows).long()
    )
    node = tree_row & ((step.offset == 0) | has_parent)  # the root or a drafted node
    leaves = (node & (children[: step.num_logits] == 0)).sum()
    return torch.stack([rows.sum(), sibling.sum(), (off_place > 0).sum(), leaves])
