"""Accepted paths' K/V into the slots right after their roots, for every layer in one launch.

After tree verification the scheduler keeps a request's first 1 + k slots (it rolls KV
back as a prefix), so the accepted path's nodes, wherever they sat among the tree's
rows, must move to rows 1..k. One program per (request, layer) walks its path in order:
move j reads row path[j] >= j + 1 and writes row j + 1, and rows written earlier (<= j)
are never read later, so the walk needs no scratch copy. A path already at rows 1..k
copies nothing.

Cache layout: vLLM's FlashAttention / Triton backends, [blocks, kv heads, page, 2 * head
dim] per layer; the layers' caches share shape, strides and dtype, and the kernel gets
their base addresses as an int64 table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _move_paths(
    CachePtrs,
    SlotMapping,
    QueryStart,
    Paths,
    NumAccepted,
    stride_path,
    stride_block,
    stride_head,
    stride_page,
    PAGE: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    ROW: tl.constexpr,
    ROW_PAD: tl.constexpr,
    DTYPE: tl.constexpr,
):
    req = tl.program_id(0)
    base = tl.load(CachePtrs + tl.program_id(1)).to(tl.pointer_type(DTYPE))
    first = tl.load(QueryStart + req)
    heads = tl.arange(0, HEADS_PAD)
    elems = tl.arange(0, ROW_PAD)
    ok = (heads < KV_HEADS)[:, None] & (elems < ROW)[None, :]
    within = heads[:, None] * stride_head + elems[None, :]
    for j in range(0, tl.load(NumAccepted + req)):
        src_row = tl.load(Paths + req * stride_path + j)
        if src_row != j + 1:
            src = tl.load(SlotMapping + first + src_row).to(tl.int64)
            dst = tl.load(SlotMapping + first + j + 1).to(tl.int64)
            x = tl.load(
                base + (src // PAGE) * stride_block + (src % PAGE) * stride_page + within, mask=ok
            )
            tl.store(
                base + (dst // PAGE) * stride_block + (dst % PAGE) * stride_page + within,
                x,
                mask=ok,
            )
        tl.debug_barrier()


class PathKVMover:
    """Built once, when the KV caches exist; called once per step."""

    def __init__(self, kv_caches: list[torch.Tensor]):
        # Layers that share one cache (KV sharing) must move it once: two programs
        # walking the same path in one cache would race.
        kv_caches = list({c.data_ptr(): c for c in kv_caches}.values())
        first = kv_caches[0]
        for cache in kv_caches:
            if (
                cache.shape != first.shape
                or cache.stride() != first.stride()
                or (cache.dtype != first.dtype)
            ):
                raise ValueError("dominotree: target layers with different KV cache layouts")
        if first.dtype not in _DTYPES:
            raise NotImplementedError(f"dominotree: KV move for {first.dtype} caches")
        self.geometry = first
        self.pointers = torch.tensor(
            [c.data_ptr() for c in kv_caches], dtype=torch.int64, device=first.device
        )

    def __call__(
        self,
        slot_mapping: torch.Tensor,  # [T] the step's slots per forward row
        query_start: torch.Tensor,  # [R + 1] each request's first forward row
        path_offsets: torch.Tensor,  # [R, W] row offsets of each accepted path
        num_accepted: torch.Tensor,  # [R]
    ) -> None:
        cache = self.geometry
        _, kv_heads, page, row = cache.shape
        num_reqs = num_accepted.shape[0]
        _move_paths[(num_reqs, self.pointers.numel())](
            self.pointers,
            slot_mapping,
            query_start,
            path_offsets,
            num_accepted,
            path_offsets.stride(0),
            cache.stride(0),
            cache.stride(1),
            cache.stride(2),
            PAGE=page,
            KV_HEADS=kv_heads,
            HEADS_PAD=triton.next_power_of_2(kv_heads),
            ROW=row,
            ROW_PAD=triton.next_power_of_2(row),
            DTYPE=_DTYPES[cache.dtype],
        )
