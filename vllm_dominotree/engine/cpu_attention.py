"""Tree verification on CPU (the CPU_ATTN backend, vLLM 0.32).

vLLM's kernel runs first over every row, causally: right for the roots, for chains and
for every row outside trees, and it writes every row's K/V into its linear slot. Then,
per branching tree, the rows whose ancestor set is not their causal prefix (`needs_fix`)
are recomputed in one masked attention: their queries against the request's cached
sequence up to the tree's last row, each row seeing the prefix, the root and its own
ancestors. One attention per tree and layer, whatever the number of leaves.

The cache is read in place: its layout depends on the ISA (the vector ISAs store a
block's keys transposed), so it is not assumed but probed once per geometry with the
backend's own writer (`probe_layout`). What the recomputation needs besides the layer's
tensors (blocks, rows, mask) is the same for every layer of a step and is built once
per step (`TreeFix`).

Accepted paths are not moved slot to slot inside the ISA's layout either: the backend
keeps a copy of the step's K/V rows per layer (`captured_kv`), which commit.py rewrites
into the path's new slots with the backend's own writer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

import numpy as np
import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from .backend_support import TREE_LACKS, check_supported
from .commit import captured_kv
from .tree_step import TreeRows, installed


@dataclass(frozen=True)
class BlockStrides:
    """A block's (head, slot, dim) elements as one strided view: the offset of element
    (h, t, d) is base + h * head + (t // slot_radix) * slot_hi + (t % slot_radix) * slot_lo
    + (d // dim_radix) * dim_hi + (d % dim_radix) * dim_lo. A radix of 1 is a plain stride;
    AMX's layout packs pairs and tiles (keys: two dims side by side, sixteen slots per tile
    row; values: two slots side by side), which a radix above 1 describes."""

    base: int
    head: int
    slot_radix: int
    slot_hi: int
    slot_lo: int
    dim_radix: int
    dim_hi: int
    dim_lo: int

    def view(self, raw: torch.Tensor, heads: int, slots: int, dims: int) -> torch.Tensor:
        """raw [n, per_block] (contiguous copies of blocks) -> [n, H, T_hi, T_lo, D_hi, D_lo]."""
        n, per_block = raw.shape
        sr, dr = self.slot_radix, self.dim_radix
        return raw.as_strided(
            (n, heads, slots // sr, sr, dims // dr, dr),
            (per_block, self.head, self.slot_hi, self.slot_lo, self.dim_hi, self.dim_lo),
            raw.storage_offset() + self.base,
        )


@dataclass(frozen=True)
class CacheLayout:
    """Where the backend's writer puts a block's keys and values: for element (head h,
    slot t, dim d) its offset among the block's raw elements (a layer's cache is
    [num_blocks, kv_heads, block_size, 2 * head_size]), and the same offsets as strides
    (`BlockStrides`) when they fit them (every ISA seen so far)."""

    key_offsets: torch.Tensor  # [H, block_size, D] int64
    value_offsets: torch.Tensor  # [H, block_size, D] int64
    key_strides: BlockStrides | None
    value_strides: BlockStrides | None

    def read(
        self, kv_cache: torch.Tensor, blocks: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys (transposed) and values of `blocks` in float32 for the scores,
        [n, H, D, block_size] and [n, H, block_size, D]: one copy of the blocks, converted
        once (the vector ISAs store keys transposed already)."""
        heads, block_size, dims = self.key_offsets.shape
        per_block = kv_cache[0].numel()
        n = len(blocks)
        if self.key_strides is None or self.value_strides is None:
            picked = kv_cache.view(-1)[blocks[:, None, None, None] * per_block + self.key_offsets]
            keys = picked.transpose(2, 3)
            values = kv_cache.view(-1)[blocks[:, None, None, None] * per_block + self.value_offsets]
            return keys.float(), values.float()
        raw = kv_cache.view(kv_cache.shape[0], per_block).index_select(0, blocks)
        keys = self.key_strides.view(raw, heads, block_size, dims).permute(0, 1, 4, 5, 2, 3)
        values = self.value_strides.view(raw, heads, block_size, dims)
        dense = torch.contiguous_format
        return (
            keys.to(torch.float32, memory_format=dense).view(n, heads, dims, block_size),
            values.to(torch.float32, memory_format=dense).view(n, heads, block_size, dims),
        )


def _split(line: torch.Tensor) -> tuple[int, int, int] | None:
    """(radix, hi, lo) with line[i] == (i // radix) * hi + (i % radix) * lo, the smallest
    radix that fits, or None. line: the offsets along one index, from 0."""
    n = len(line)
    i = torch.arange(n)
    for radix in (r for r in range(1, n + 1) if n % r == 0):
        lo = int(line[1]) if radix > 1 else 0
        hi = int(line[radix]) if radix < n else 0
        if torch.equal((i // radix) * hi + (i % radix) * lo, line):
            return radix, hi, lo
    return None


def _strides(offsets: torch.Tensor) -> BlockStrides | None:
    base = int(offsets[0, 0, 0])
    heads, slots, dims = offsets.shape
    head = int(offsets[1, 0, 0]) - base if heads > 1 else 0
    slot, dim = _split(offsets[0, :, 0] - base), _split(offsets[0, 0, :] - base)
    if slot is None or dim is None:
        return None
    strides = BlockStrides(base, head, *slot, *dim)
    h, t, d = torch.arange(heads), torch.arange(slots), torch.arange(dims)
    t_part = (t // slot[0]) * slot[1] + (t % slot[0]) * slot[2]
    d_part = (d // dim[0]) * dim[1] + (d % dim[0]) * dim[2]
    fitted = base + head * h[:, None, None] + t_part[None, :, None] + d_part[None, None, :]
    return strides if torch.equal(fitted, offsets) else None


def write_cache(
    kv_cache: torch.Tensor,  # [num_blocks, kv_heads, block_size, 2 * D]
    isa: str,
    keys: torch.Tensor,  # [T, kv_heads, D]
    values: torch.Tensor,  # [T, kv_heads, D]
    slots: torch.Tensor,  # [T]
) -> None:
    """vLLM's CPU cache writer on a layer's raw cache (unquantized)."""
    num_blocks, heads, block_size, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(num_blocks, heads, 2 * block_size, -1).chunk(2, 2)
    ops.cpu_attn_reshape_and_cache(
        keys, values, key_cache, value_cache, slots, isa, 1.0, 1.0, kv_cache_dtype="auto"
    )


@cache
def probe_layout(
    isa: str, dtype: torch.dtype, heads: int, block_size: int, head_size: int
) -> CacheLayout:
    """Write numbered keys (then values) into block 1 of a scratch cache with the
    backend's own writer and read back where each number landed. Numbers go in base-128
    digits, one pass per digit, so that every cache dtype holds them exactly."""
    count = block_size * heads * head_size
    ids = torch.arange(count).view(block_size, heads, head_size)  # the writer's [T, H, D]
    digits = max(1, int(np.ceil(np.log(count) / np.log(128))))
    offsets = {}
    for which in ("key", "value"):
        landed, number = None, torch.zeros(heads * block_size * 2 * head_size, dtype=torch.int64)
        for digit in range(digits):
            cache = torch.full((2, heads, block_size, 2 * head_size), -1.0, dtype=dtype)
            numbered = ((ids >> (7 * digit)) & 127).to(dtype)
            blank = torch.full_like(numbered, -1.0)
            key, value = (numbered, blank) if which == "key" else (blank, numbered)
            write_cache(cache, isa, key, value, torch.arange(block_size, 2 * block_size))
            raw = cache[1].reshape(-1)
            here = raw >= 0
            if landed is not None and not torch.equal(here, landed):
                landed = None
                break
            landed = here
            number[here] += raw[here].long() << (7 * digit)
        at = torch.nonzero(landed).view(-1) if landed is not None else torch.empty(0)
        found = torch.full((count,), -1, dtype=torch.int64)
        if len(at) == count and int(number[at].max()) < count:
            found[number[at]] = at
        if len(at) != count or (found < 0).any():
            raise NotImplementedError(
                f"dominotree: the CPU attention cache of ISA {isa!r} ({dtype}) does not store "
                "the keys and values as plain copies; tree verification cannot read it"
            )
        offsets[which] = found.view(block_size, heads, head_size).permute(1, 0, 2).contiguous()
    k, v = offsets["key"], offsets["value"]
    return CacheLayout(k, v, _strides(k), _strides(v))


@dataclass
class TreeFix:
    """One branching tree's recomputed rows, the same for every layer of a step."""

    rows: torch.Tensor  # [F] forward rows whose output is replaced
    blocks: torch.Tensor  # [n] the request's blocks holding positions 0 .. length - 1
    length: int  # the root's position + the tree's rows
    mask: torch.Tensor  # [F, length] bool: what each recomputed row sees
    _bias: dict = field(default_factory=dict)  # per query-head group: the mask as a bias

    def bias(self, group: int, block_size: int) -> torch.Tensor:
        """[n, 1, group * F, block_size] float32: 0 where a row sees a slot, -inf where
        it does not (and past the sequence), laid out as the blocks' scores."""
        if group not in self._bias:
            rows = len(self.rows)
            flat = torch.full((group * rows, len(self.blocks) * block_size), float("-inf"))
            flat[:, : self.length].masked_fill_(self.mask.repeat(group, 1), 0.0)
            blocks = flat.view(group * rows, len(self.blocks), block_size).transpose(0, 1)
            self._bias[group] = blocks[:, None].contiguous()
        return self._bias[group]


def tree_fix(
    tree: TreeRows,
    needs_fix: np.ndarray,  # [n] bool, per row of the tree
    ancestors: np.ndarray,  # [n] int64 ancestor bits (tree_step.py)
    block_table: torch.Tensor,  # [max_blocks] the request's row of the block table
    block_size: int,
) -> TreeFix | None:
    if not needs_fix.any():
        return None
    n = tree.num_rows
    length = tree.start + n
    mask = np.ones((int(needs_fix.sum()), length), dtype=bool)
    # Row j of the tree sits at position start + j; bit j - 1 says "is an ancestor".
    mask[:, tree.start + 1 :] = (ancestors[needs_fix, None] >> np.arange(n - 1)[None, :]) & 1
    rows = torch.from_numpy(np.nonzero(needs_fix)[0] + tree.token_row)
    blocks = block_table[: -(-length // block_size)].long()
    return TreeFix(rows, blocks, length, torch.from_numpy(mask))


def recompute_rows(
    query: torch.Tensor,  # [tokens, heads, D]
    kv_cache: torch.Tensor,  # [num_blocks, kv_heads, block_size, 2 * D], rows written
    output: torch.Tensor,  # [tokens, heads * D] or [tokens, heads, D]
    fixes: list[TreeFix],
    layout: CacheLayout,
    scale: float,
) -> None:
    """Overwrite the fixed rows' outputs with their ancestor-only attention, computed
    block by block of the request's cache (float32 scores and sums): the softmax runs
    over the blocks and their slots at once, so no block is copied into one sequence."""
    heads, dims = query.shape[1], query.shape[2]
    kv_heads = kv_cache.shape[1]
    group = heads // kv_heads
    for fix in fixes:
        keys_t, values = layout.read(kv_cache, fix.blocks)  # [n, Hk, D, bs], [n, Hk, bs, D]
        rows = len(fix.rows)
        # Query head h * group + g reads KV head h: [Hk, group * F, D], rows g-major.
        q = query[fix.rows].float().view(rows, kv_heads, group, dims)
        q = q.permute(1, 2, 0, 3).reshape(kv_heads, group * rows, dims)
        scores = torch.matmul(q, keys_t)  # [n, Hk, group * F, bs]
        scores.mul_(scale).add_(fix.bias(group, keys_t.shape[-1]))
        scores.sub_(scores.amax(dim=(0, 3), keepdim=True)).exp_()
        total = scores.sum(dim=(0, 3))[..., None]  # [Hk, group * F, 1]
        o = torch.matmul(scores, values).sum(0).div_(total)  # [Hk, group * F, D]
        o = o.view(kv_heads, group, rows, dims).permute(2, 0, 1, 3).reshape(rows, heads * dims)
        output[fix.rows] = o.to(output.dtype).view(rows, *output.shape[1:])


# The current step's fixes (step, then per attention metadata, i.e. per KV cache group).
_step_fixes: dict = {"step": None}


class TreeCPUAttentionImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, **kwargs):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, **kwargs)
        verification = installed()
        step = verification.step if verification is not None else None
        if step is None or attn_metadata is None or layer.layer_name not in verification.layers:
            return out
        check_supported(self, TREE_LACKS, "CPU")
        rows = step.num_tokens
        captured_kv[layer.layer_name] = (key[:rows].clone(), value[:rows].clone())
        if not step.any_fix:
            return out
        if not kv_cache.is_contiguous():
            raise NotImplementedError("dominotree: CPU tree verification needs a contiguous cache")
        _, heads, block_size, _ = kv_cache.shape
        layout = probe_layout(layer.isa, kv_cache.dtype, heads, block_size, self.head_size)
        fixes = self._fixes(verification, attn_metadata, block_size)
        recompute_rows(query, kv_cache, output, fixes, layout, self.scale)
        return out

    @staticmethod
    def _fixes(verification, md, block_size: int) -> list[TreeFix]:
        step = verification.step
        if _step_fixes["step"] is not step:
            _step_fixes.clear()
            _step_fixes["step"] = step
        fixes = _step_fixes.get(id(md))
        if fixes is None:
            needs_fix = verification.buffers.token_needs_fix.numpy().astype(bool)
            ancestors = verification.buffers.token_ancestors.numpy()
            fixes = []
            for t in step.trees:
                rows = slice(t.token_row, t.token_row + t.num_rows)
                table = md.block_table[t.batch_index]
                fix = tree_fix(t, needs_fix[rows], ancestors[rows], table, block_size)
                if fix is not None:
                    fixes.append(fix)
            _step_fixes[id(md)] = fixes
        return fixes


class TreeCPUAttentionBackend(CPUAttentionBackend):
    """CPU_ATTN with tree verification. get_name() stays "CPU_ATTN" (vLLM maps the
    name back to its enum)."""

    @staticmethod
    def get_impl_cls():
        return TreeCPUAttentionImpl
