"""The top M of each row of the drafter's logits over the vocabulary (Triton), two launches.

The scorers' `prepare` restricts every depth's candidates to the marginal top M
(tree/scorers.py): on the H200 torch.topk over [requests x 16, 151,936] bf16 logits took
99 us at batch 1, 422 at 16 and 1,204 at 64 (benchmarks/results/h200_2026-12-04d), a
third of the build at batch 16 and half of it at 64, for 5-311 MB read: far from what
reading them costs. Here:
1. one program per (row, block of BLOCK logits): the block's top M, found by a
   five-way search over the values' order-preserving integer keys (four counts per
   round in one reduction: 7 rounds for bf16, 14 for 32-bit floats), written in index
   order;
2. one program per row: the top M of its blocks' candidates by the same search, sorted
   best first.
Order: larger value first, equal values by smaller index (torch.topk leaves ties in no
set order; both tree builders read this one result, so their trees stay identical).
Rows shorter than a block and blocks holding fewer than M logits are padded with
entries that never win (index -1 after the first stage).
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

BLOCK = 4096  # logits per first-stage program (< 2^16: _best packs its counts in 16 bits)


def search_rounds(key_bits: int) -> int:
    """Rounds of _best's five-way search that narrow 2^key_bits keys to one."""
    span, rounds = 2**key_bits - 1, 0
    while span > 0:
        cuts = [0, *((k * span + 4) // 5 for k in range(1, 5)), span + 1]
        span = max(b - a for a, b in itertools.pairwise(cuts)) - 1
        rounds += 1
    return rounds


@triton.jit
def _order_key(x, SHIFT: tl.constexpr):
    """float32 -> int32 whose signed order is the floats' order (bit-cast, the lower 31
    bits of negatives flipped), shifted right by SHIFT (16 for bf16 inputs, whose lower
    16 bits are zero)."""
    bits = x.to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)) >> SHIFT


@triton.jit
def _count_from(key, valid, t):
    """1 for each valid key that reaches t (int64: _best packs four such counts, 16 bits
    each, into one sum)."""
    return ((key >= t) & valid).to(tl.int64)


@triton.jit
def _best(key, valid, M, KEY_BITS: tl.constexpr, ROUNDS: tl.constexpr):
    """-> a [N] mask of the M best entries of `valid`: every key above the M-th best
    (the largest threshold that M or more keys reach) and, of the keys equal to it, the
    first ones in index order. The threshold is found by a five-way search: each round
    counts the keys reaching four thresholds at once (one block-wide reduction; the
    reductions, not the compares, bound a round), keeping the fifth of the range that
    holds it (ROUNDS: search_rounds(KEY_BITS))."""
    lo = tl.full([], -(2 ** (KEY_BITS - 1)), tl.int64)  # count(key >= lo) >= M, or none is
    hi = tl.full([], 2 ** (KEY_BITS - 1) - 1, tl.int64)
    for _ in range(ROUNDS):
        span = hi - lo
        t1 = lo + (span + 4) // 5
        t2 = lo + (2 * span + 4) // 5
        t3 = lo + (3 * span + 4) // 5
        t4 = lo + (4 * span + 4) // 5
        packed = tl.sum(
            _count_from(key, valid, t1)
            + (_count_from(key, valid, t2) << 16)
            + (_count_from(key, valid, t3) << 32)
            + (_count_from(key, valid, t4) << 48),
            axis=0,
        )
        ok1 = (packed & 0xFFFF) >= M
        ok2 = ((packed >> 16) & 0xFFFF) >= M
        ok3 = ((packed >> 32) & 0xFFFF) >= M
        ok4 = ((packed >> 48) & 0xFFFF) >= M
        new_lo = tl.where(ok4, t4, tl.where(ok3, t3, tl.where(ok2, t2, tl.where(ok1, t1, lo))))
        hi = tl.where(
            ok4, hi, tl.where(ok3, t4 - 1, tl.where(ok2, t3 - 1, tl.where(ok1, t2 - 1, t1 - 1)))
        )
        hi = tl.maximum(hi, new_lo)  # span 0: every threshold is lo
        lo = new_lo
    above = valid & (key > lo)
    tie = valid & (key == lo)
    tie_rank = tl.cumsum(tie.to(tl.int32), axis=0) - 1
    return above | (tie & (tie_rank < M - tl.sum(above.to(tl.int32), axis=0)))


@triton.jit
def _block_top(
    Logits,  # [rows, V]
    Values,  # [rows, blocks, M_P2] out
    Index,  # [rows, blocks, M_P2] int32 out (-1: padding)
    V,
    row_stride,
    M: tl.constexpr,
    M_P2: tl.constexpr,
    BLOCK: tl.constexpr,
    SHIFT: tl.constexpr,
    KEY_BITS: tl.constexpr,
    ROUNDS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    blocks = tl.num_programs(1)
    column = block * BLOCK + tl.arange(0, BLOCK)
    valid = column < V
    x = tl.load(Logits + row * row_stride + column, mask=valid, other=0.0).to(tl.float32)
    chosen = _best(_order_key(x, SHIFT), valid, M, KEY_BITS, ROUNDS)
    at = tl.cumsum(chosen.to(tl.int32), axis=0) - 1  # index order
    out = (row * blocks + block) * M_P2
    slot = tl.arange(0, M_P2)
    # Slots the block does not fill (fewer than M logits, or past M) never win.
    tl.store(Index + out + slot, tl.full([M_P2], -1, tl.int32))
    tl.debug_barrier()
    tl.store(Values + out + at, x.to(Values.dtype.element_ty), mask=chosen)
    tl.store(Index + out + at, column, mask=chosen)


@triton.jit
def _row_top(
    Values,  # [rows, blocks * M_P2] the blocks' candidates
    Index,
    OutValues,  # [rows, M] out, best first
    OutIndex,  # [rows, M] int64 out
    width,  # blocks * M_P2
    M: tl.constexpr,
    M_P2: tl.constexpr,
    CANDIDATES: tl.constexpr,  # next power of two >= width
    SHIFT: tl.constexpr,
    KEY_BITS: tl.constexpr,
    ROUNDS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CANDIDATES)
    index = tl.load(Index + row * width + c, mask=c < width, other=-1)
    valid = index >= 0
    x = tl.load(Values + row * width + c, mask=valid, other=0.0).to(tl.float32)
    chosen = _best(_order_key(x, SHIFT), valid, M, KEY_BITS, ROUNDS)
    at = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
    out = row * M
    tl.store(OutValues + out + at, x.to(OutValues.dtype.element_ty), mask=chosen)
    tl.store(OutIndex + out + at, index.to(tl.int64), mask=chosen)
    tl.debug_barrier()
    # The M winners, in index order: each one's place best first is how many beat it.
    slot = tl.arange(0, M_P2)
    live = slot < M
    value = tl.load(OutValues + out + slot, mask=live, other=0.0).to(tl.float32)
    token = tl.load(OutIndex + out + slot, mask=live, other=0)
    beats = (value[None, :] > value[:, None]) | (
        (value[None, :] == value[:, None]) & (token[None, :] < token[:, None])
    )
    place = tl.sum((beats & live[None, :]).to(tl.int32), axis=1)
    tl.debug_barrier()
    tl.store(OutValues + out + place, value.to(OutValues.dtype.element_ty), mask=live)
    tl.store(OutIndex + out + place, token, mask=live)


def vocab_topk(logits: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] (CUDA, or Triton's interpreter) -> (values [..., m] best first,
    indices [..., m] long), as torch.topk(logits, m) up to the order of equal values."""
    *lead, vocab = logits.shape
    if not 0 < m <= vocab:
        raise ValueError(f"dominotree: top {m} of {vocab} logits")
    rows = logits.reshape(-1, vocab)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    n = rows.shape[0]
    m_p2 = triton.next_power_of_2(m)
    blocks = triton.cdiv(vocab, BLOCK)
    # bf16's float32 values have 16 low zero bits: half the search.
    shift, key_bits = (16, 16) if rows.dtype == torch.bfloat16 else (0, 32)
    block_values = torch.empty(n, blocks, m_p2, dtype=rows.dtype, device=rows.device)
    block_index = torch.empty(n, blocks, m_p2, dtype=torch.int32, device=rows.device)
    values = torch.empty(n, m, dtype=rows.dtype, device=rows.device)
    index = torch.empty(n, m, dtype=torch.long, device=rows.device)
    if n:
        _block_top[(n, blocks)](
            rows, block_values, block_index, vocab, rows.stride(0),
            M=m, M_P2=m_p2, BLOCK=BLOCK, SHIFT=shift, KEY_BITS=key_bits,
            ROUNDS=search_rounds(key_bits), num_warps=8,
        )  # fmt: skip
        width = blocks * m_p2
        if triton.next_power_of_2(width) >= 1 << 16:  # _best's 16-bit counts
            raise ValueError(f"dominotree: top {m} of {vocab} logits: too many candidates")
        _row_top[(n,)](
            block_values, block_index, values, index, width,
            M=m, M_P2=m_p2, CANDIDATES=triton.next_power_of_2(width), SHIFT=shift,
            KEY_BITS=key_bits, ROUNDS=search_rounds(key_bits), num_warps=8,
        )  # fmt: skip
    return values.view(*lead, m), index.view(*lead, m)
