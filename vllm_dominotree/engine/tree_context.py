"""Tree verification inside vLLM's attention: the per-step context the backends read.

vLLM's attention kernels know only causal (or fully non-causal) attention per request.
During the target's verification forward the runner publishes a `TreeAttentionContext`:
which rows belong to trees, their ancestor structure, and which layers are the target's
(the DFlash drafter's layers run through the same backend and must be left alone).
The backend then
- fixes the outputs of tree rows so that each attends the committed prefix, its
  ancestors and itself only (rows of chains are already right under causal attention):
  cpu_attention.py on CPU, cuda_attention.py (a Triton kernel) on CUDA;
- makes the accepted path's K/V movable into the slots right after the root
  (`rewrite_accepted_kv`). On CPU, whose cache layout depends on the ISA, the backend
  keeps a copy of the tree rows' K/V (`capture`) and rewrites them with its own cache
  writer. On CUDA the cache is [blocks, kv heads, page, 2 * head dim] (FlashAttention
  and Triton backends): the backend only registers its cache (`keep_cache`), and the
  accepted rows move slot to slot inside it, so a step without moves costs nothing.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field

import torch

from .verify import TreeRows


@dataclass
class TreeAttentionContext:
    trees: list[TreeRows]
    layer_names: frozenset[str]  # the target model's attention layers
    # layer name -> (key rows, value rows, slot rows) of every tree row in this step
    captured: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )
    # layer name -> (kv cache [blocks, kv heads, page, 2 * head dim], slot mapping)
    in_cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # What a backend computes once per step for all layers (keys are the backend's).
    backend_cache: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rows = torch.tensor(
            [t.row_start + i for t in self.trees for i in range(t.num_rows)], dtype=torch.long
        )
        # Index of each tree's root among the captured rows.
        bases = itertools.accumulate((t.num_rows for t in self.trees), initial=0)
        self._base = {id(t): b for t, b in zip(self.trees, bases, strict=False)}
        self.branching = [t for t in self.trees if not t.is_chain]
        self._kernel_meta = None

    def capture(self, layer_name, key, value, slot_mapping) -> None:
        """Keep this layer's tree-row K/V and slots (CPU; index gathers copy: no clone)."""
        rows = self.rows
        self.captured[layer_name] = (key[rows], value[rows], slot_mapping[rows])

    def keep_cache(self, layer_name, kv_cache, slot_mapping) -> None:
        """The tree rows' K/V stay where the stock kernel wrote them (CUDA layout)."""
        self.in_cache[layer_name] = (kv_cache, slot_mapping)

    def kernel_meta(self, device: torch.device):
        """The branching trees as the CUDA kernel's TreeBatchMeta (built once a step)."""
        if self._kernel_meta is None:
            from ..kernels.tree_attention import TreeBatchMeta

            trees = self.branching
            size = max(t.num_rows for t in trees)
            masks = torch.zeros(len(trees), size, size, dtype=torch.int8)
            for b, t in enumerate(trees):
                masks[b, : t.num_rows, : t.num_rows] = t.ancestor_mask()

            def ints(values):
                return torch.tensor(values, dtype=torch.int32, device=device)

            self._kernel_meta = TreeBatchMeta(
                first_rows=ints([t.row_start for t in trees]),
                requests=ints([t.batch_index for t in trees]),
                starts=ints([t.start for t in trees]),
                sizes=ints([t.num_rows for t in trees]),
                masks=masks.to(device),
                rows=torch.tensor([t.row_start + i for t in trees for i in range(t.num_rows)],
                                  device=device),
                offsets=ints([sum(t.num_rows for t in trees[:b]) for b in range(len(trees))]),
                row_trees=ints([b for b, t in enumerate(trees) for _ in range(t.num_rows)]),
                max_size=size,
                max_seq_len=max(t.start + t.num_rows for t in trees),
            )  # fmt: skip
        return self._kernel_meta

    def row_of(self, tree: TreeRows, offset: int) -> int:
        """Index into the captured rows of a tree's row `offset`."""
        return self._base[id(tree)] + offset


_ACTIVE: TreeAttentionContext | None = None


def active_context() -> TreeAttentionContext | None:
    return _ACTIVE


@contextlib.contextmanager
def published(ctx: TreeAttentionContext | None):
    """Publish `ctx` to the attention backend for the duration of the target forward."""
    global _ACTIVE
    _ACTIVE = ctx
    try:
        yield
    finally:
        _ACTIVE = None


def rewrite_accepted_kv(layers: dict, ctx: TreeAttentionContext, moves) -> None:
    """Write each accepted path's K/V into the slots right after its root.
    moves: (tree rows, accepted path) pairs whose path is not already rows 1..k."""
    src, dst = [], []
    for tree, path in moves:
        src += [ctx.row_of(tree, node) for node in path]
        dst += [ctx.row_of(tree, j) for j in range(1, len(path) + 1)]
    if not src:
        return
    for name, (keys, values, slots) in ctx.captured.items():
        layer = layers[name]
        index = torch.tensor(src, device=keys.device)
        dst_slots = slots[torch.tensor(dst, device=slots.device)]
        layer.impl.do_kv_cache_update(layer, keys[index], values[index], layer.kv_cache, dst_slots)
    slot_pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for kv_cache, slot_mapping in ctx.in_cache.values():
        pair = slot_pairs.get(id(slot_mapping))
        if pair is None:  # layers of one KV group share the step's slot mapping
            rows = ctx.rows.to(slot_mapping.device)
            pair = slot_pairs[id(slot_mapping)] = (
                slot_mapping[rows[torch.tensor(src, device=rows.device)]].long(),
                slot_mapping[rows[torch.tensor(dst, device=rows.device)]].long(),
            )
        move_slots(kv_cache, *pair)


def move_slots(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """kv_cache: [blocks, kv heads, page, 2 * head dim]; copy slot src[i] to dst[i] (all
    sources are read before any destination is written)."""
    page = kv_cache.shape[2]
    kv_cache[dst // page, :, dst % page] = kv_cache[src // page, :, src % page]
