"""A tree's own rows in ancestor-only attention, merged with a pass over the prefix (Triton).

One pass with a merge (DOMINOTREE_CUDA_TREE_ATTENTION=one-pass-merge, engine/
cuda_attention.py): in a step whose requests are all trees, FA3 attends every row of a
request over that request's committed prefix only (non-causal, log-sum-exp returned), so
each prefix is read once whatever the tree's shape (path requests read it once per
root-to-leaf path: 16 times for a star of 16 leaves). What that pass leaves out is a
row's view of its own tree: the root, its ancestors and itself. This kernel attends each
row over those rows, with the K/V this forward computed for them (the values vLLM wrote
into the cache: the cache holds the model's own dtype, backend_support refuses quantized
caches), and merges both parts by log-sum-exp into the layer's output, in one launch.

Mathematically the rows equal the stock causal kernel's where their ancestors are their
causal prefix; in bf16 they round differently (two partial softmaxes merged, not FA3's
single pass), as vLLM's DFlash verification rows round differently from decoding's.

Grid: one program per (row, KV head): the GQA group of query heads of one row. A row's
tree starts at row - offset (its offset from the root, engine/tree_step.py); row j >= 1
of the tree is visible iff bit j - 1 of the row's ancestor bits is set, the root always.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KEY_TILE = 16  # tree rows per inner step: budget 16 -> two steps at most
LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)  # the kernel's copy (a jit function reads constexpr globals)


@triton.jit
def _tree_part_merged(
    Q,  # [T, H, D]
    K,  # [T, KVH, D]: this forward's keys
    V,  # [T, KVH, D]
    PrefixOut,  # [T, H, D]: each row over its request's prefix
    PrefixLse,  # [H, T] natural log-sum-exp of the prefix pass (FA's layout)
    Ancestors,  # [T] int64 bits
    Offset,  # [T] int64: the row's offset from its tree's root
    Out,  # [T, H, D]
    scale_log2,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_pt,
    stride_ph,
    stride_lh,
    stride_lt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KEY_TILE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    g = tl.arange(0, GROUP_P2)
    in_group = g < GROUP
    heads = kv_head * GROUP + g
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        Q + row * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=in_group[:, None],
        other=0.0,
    ).to(tl.float32)
    offset = tl.load(Offset + row)
    bits = tl.load(Ancestors + row)
    root = tl.maximum(row - offset, 0)  # a stale offset must not read before the rows

    best = tl.full([GROUP_P2], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, HEAD_DIM], tl.float32)
    for start in range(0, offset + 1, KEY_TILE):
        j = start + tl.arange(0, KEY_TILE)  # offsets from the root
        bit = (bits >> tl.maximum(j - 1, 0).to(tl.int64)) & 1
        seen = (j == 0) | ((j <= offset) & (bit == 1))
        key_rows = root + j
        k = tl.load(
            K + key_rows[:, None] * stride_kt + kv_head * stride_kh + dims[None, :],
            mask=seen[:, None],
            other=0.0,
        ).to(tl.float32)
        v = tl.load(
            V + key_rows[:, None] * stride_vt + kv_head * stride_vh + dims[None, :],
            mask=seen[:, None],
            other=0.0,
        ).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale_log2  # [G, KEY_TILE]
        s = tl.where(seen[None, :], s, float("-inf"))
        new_best = tl.maximum(best, tl.max(s, axis=1))  # finite: the root is always seen
        alpha = tl.exp2(best - new_best)
        p = tl.exp2(s - new_best[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        best = new_best
    tree_lse = best + tl.log2(total)  # base 2

    # FA writes +inf as the log-sum-exp of a row that saw no key (an empty prefix: graph
    # padding); it weighs nothing.
    prefix_lse = tl.load(PrefixLse + heads * stride_lh + row * stride_lt, mask=in_group, other=0.0)
    prefix_lse = tl.where(prefix_lse == float("inf"), float("-inf"), prefix_lse * _LOG2E)
    prefix = tl.load(
        PrefixOut + row * stride_pt + heads[:, None] * stride_ph + dims[None, :],
        mask=in_group[:, None],
        other=0.0,
    ).to(tl.float32)
    top = tl.maximum(prefix_lse, tree_lse)
    w_prefix = tl.exp2(prefix_lse - top)
    w_tree = tl.exp2(tree_lse - top)
    merged = tl.where(w_prefix[:, None] > 0, prefix * w_prefix[:, None], 0.0)
    merged = (merged + acc * (w_tree / total)[:, None]) / (w_prefix + w_tree)[:, None]
    tl.store(
        Out + row * stride_ot + heads[:, None] * stride_oh + dims[None, :],
        merged.to(Out.dtype.element_ty),
        mask=in_group[:, None],
    )


def check_merge_shape(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """The layer shapes the kernel takes (checked when the engine starts, and here)."""
    if num_heads % num_kv_heads or head_dim & (head_dim - 1):
        raise ValueError(
            f"dominotree: the merged tree attention takes a power-of-two head size and "
            f"whole GQA groups (heads {num_heads}, KV heads {num_kv_heads}, head size "
            f"{head_dim}); use DOMINOTREE_CUDA_TREE_ATTENTION=one-pass"
        )


def merge_tree_part(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, KVH, D]: this forward's keys (as written to the cache)
    value: torch.Tensor,  # [T, KVH, D]
    prefix_out: torch.Tensor,  # [T, H, D]: the rows over their requests' prefixes
    prefix_lse: torch.Tensor,  # [H, T] natural log-sum-exp of that pass
    ancestors: torch.Tensor,  # [>= T] int64 ancestor bits (engine/tree_step.py)
    offset: torch.Tensor,  # [>= T] int64 offsets from the trees' roots
    scale: float,
    out: torch.Tensor,  # [T, H, D]: every row written
) -> None:
    """Every row's attention over prefix + its visible tree rows, into `out`."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    check_merge_shape(num_heads, num_kv_heads, head_dim)
    group = num_heads // num_kv_heads
    for t in (query, key, value, prefix_out, out):
        if t.stride(-1) != 1:
            raise ValueError("dominotree: the merged tree attention reads rows of unit stride")
    _tree_part_merged[(num_tokens, num_kv_heads)](
        query,
        key,
        value,
        prefix_out,
        prefix_lse,
        ancestors,
        offset,
        out,
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        prefix_out.stride(0),
        prefix_out.stride(1),
        prefix_lse.stride(0),
        prefix_lse.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GROUP_P2=triton.next_power_of_2(group),
        HEAD_DIM=head_dim,
        KEY_TILE=KEY_TILE,
    )
