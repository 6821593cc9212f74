"""After acceptance: make the accepted path look like a chain to vLLM and the drafter.

vLLM keeps a request's first 1 + k verification slots (its scheduler rolls KV back as a
prefix) and the DFlash proposer takes the first 1 + k rows of each request as the new
context (ids, aux hidden states, positions). For a tree the path's nodes can sit at any
rows, so:
- their K/V move to rows 1..k of the target's cache: on CUDA one launch for all layers,
  inside the cache (kernels/kv_move.py); on CPU, whose cache layout depends on the ISA,
  the backend's own writer rewrites the copies it kept (cpu_attention.captured_kv);
- the drafter's rows are reordered on the device (root, path, then the rejected rows)
  and every tree row gets its linear position back, so rejected rows land in the
  drafter's context slots after the path, never on top of an accepted node's.
A path that is already rows 1..k moves nothing.
"""

from __future__ import annotations

import torch

from .acceptance import Accepted
from .tree_step import TreeStep

# CPU: layer name -> (keys, values) of the step's rows as the forward computed them
# (written by cpu_attention.py during the forward, read once after acceptance).
captured_kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def moved_rows(
    path_offsets: torch.Tensor,  # [R, W] row offsets of each accepted path
    num_accepted: torch.Tensor,  # [R]
    query_start: torch.Tensor,  # [R + 1] each request's first forward row
) -> tuple[torch.Tensor, torch.Tensor]:
    """(source rows, destination rows) of the forward for every accepted node that is not
    already in place (host-side selection: CPU only)."""
    depth = torch.arange(path_offsets.shape[1], device=query_start.device)
    on_path = depth[None, :] < num_accepted[:, None]
    first = query_start[:-1, None].long()
    src, dst = first + path_offsets, first + 1 + depth[None, :]
    keep = on_path & (src != dst)
    return src[keep], dst[keep]


class CpuPathKVMover:
    """The CPU counterpart of kernels.kv_move.PathKVMover."""

    def __init__(self, layers: dict):
        self.layers = layers  # target layer name -> vLLM attention layer

    def __call__(self, slot_mapping, query_start, path_offsets, num_accepted) -> None:
        src, dst = moved_rows(path_offsets, num_accepted, query_start)
        if not src.numel():
            return
        slots = slot_mapping[dst]
        for name, (keys, values) in captured_kv.items():
            layer = self.layers[name]
            layer.impl.do_kv_cache_update(layer, keys[src], values[src], layer.kv_cache, slots)


def target_kv(kv_cache_config, layers: dict, device: torch.device):
    """(the target's KV cache group, its accepted-path K/V mover) for the target's
    attention layers (name -> vLLM attention layer), once the KV caches exist."""
    names = sorted(layers)
    group = next(
        g for g, kv in enumerate(kv_cache_config.kv_cache_groups) if names[0] in kv.layer_names
    )
    if device.type == "cuda":
        from ..kernels.kv_move import PathKVMover

        return group, PathKVMover([layers[n].kv_cache for n in names])
    return group, CpuPathKVMover(layers)


def drafter_rows_first(
    step: TreeStep,
    accepted: Accepted,
    input_ids: torch.Tensor,  # [>= T] the forward's token ids
    positions: torch.Tensor,  # [>= T] its positions (tree positions on tree rows)
    aux_hidden_states: list[torch.Tensor] | None,  # each [>= T, H]
) -> None:
    """Per tree: root, accepted path, then the other rows; linear positions throughout."""
    width = step.width
    rank = torch.where(accepted.accepted, step.depth, width + 1 + step.offset)
    rank = torch.where(step.in_tree.bool() & (step.offset > 0), rank, 0)
    # Logits rows of a request are contiguous and requests come in order: sorting by
    # (request, rank) permutes rows within their own request only.
    order = torch.argsort(step.request * (2 * width + 2) + rank)
    num_tokens = step.num_tokens
    perm = torch.arange(num_tokens, device=input_ids.device)
    perm[step.token_row] = step.token_row[order]
    for rows in (input_ids, *(aux_hidden_states or [])):
        rows[:num_tokens] = rows[perm]  # the gather copies before the scatter writes
    positions[:num_tokens] -= step.token_delta
