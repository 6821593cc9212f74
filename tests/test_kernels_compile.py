"""Every Triton kernel of the plugin compiled for the H200 (sm_90) on this GPU-less machine,
in the configurations the engine launches: Triton's own compiler and the ptxas its wheel
carries, no device. Triton's interpreter (the other CPU tests) checks what the kernels
compute but not whether they compile; a kernel that fails here would fail on the H200's
first launch. (Triton here is CI's; the H200's vLLM stage has its own, 3.6 in 2026-12.)"""

from __future__ import annotations

import itertools
import subprocess

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource, compile

from vllm_dominotree.kernels import (
    domino_step,
    kv_move,
    path_build,
    tree_accept,
    tree_attention,
    tree_attention_fa3,
    tree_merge,
)

H200 = GPUTarget("cuda", 90, 32)
H200_SHARED = 227 * 1024  # shared memory a block may take (a launch past it fails)


def compiled(kernel, types: dict[str, str], constexprs: dict, **options):
    """Compile `kernel` for sm_90; arguments not named in types are i32 scalars."""
    signature = {
        name: "constexpr" if name in constexprs else types.get(name, "i32")
        for name in kernel.arg_names
    }
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return compile(source, target=H200, options=options)


@pytest.mark.parametrize("every_row", [False, True])
def test_the_path_build_compiles(every_row):
    types = dict(
        Trees="*i64",
        Ancestors="*i64",
        NeedsFix="*i64",
        Counts="*i32",
        Positions="*i64",
        BlockTable="*i32",
        SlotMapping="*i64",
        SlotTable="*i32",
        SeqUsed="*i32",
        QueryStart="*i32",
        QueryRows="*i64",
        RowOwned="*i1",
        RowToQuery="*i64",
    )
    shape = {"W_PAD": triton.next_power_of_2(17), "EVERY_ROW": every_row}  # budget 16
    assert compiled(path_build._count_paths, types, shape).asm["cubin"]
    blocks = {"TREE_BLOCK": path_build.TREE_BLOCK, "KEY_BLOCK": path_build.KEY_BLOCK}
    assert compiled(path_build._fill_paths, types, {**shape, **blocks}).asm["cubin"]


# Beside vLLM's Triton attention: its key tiles, one split; beside FA3: key splits merged
# in the launch, or one split when the partial buffers are short.
VARIANTS = {
    "like-triton": (tree_attention.TRITON_KEY_TILE, True),
    "splits": (tree_attention.FAST_KEY_TILE, False),
    "one-split": (tree_attention.FAST_KEY_TILE, True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (32, 8, 128)])
def test_the_tree_fixup_compiles(variant, dtype, heads, kv_heads, head_dim):
    kernel = tree_attention._tree_rows_attention
    types = dict(
        Q=f"*{dtype}",
        K=f"*{dtype}",
        V=f"*{dtype}",
        Out=f"*{dtype}",
        BlockTable="*i32",
        QueryStart="*i32",
        SeqLens="*i32",
        Ancestors="*i64",
        NeedsFix="*i64",
        PartAcc="*fp32",
        PartMax="*fp32",
        PartSum="*fp32",
        Counters="*i32",
        scale="fp32",
    )
    group = heads // kv_heads
    rows = triton.next_power_of_2(17)
    key_tile, direct = VARIANTS[variant]
    constexprs = dict(
        GROUP=group,
        GROUP_PAD=triton.next_power_of_2(group),
        HEAD_DIM=head_dim,
        PAGE=16,
        ROWS=rows,
        KEY_TILE=key_tile,
        DIRECT=direct,
    )
    warps = 8 if rows * constexprs["GROUP_PAD"] * head_dim >= 128 * 128 else 4
    assert compiled(kernel, types, constexprs, num_warps=warps).asm["cubin"]


# FA3's fast math as PTX (1: `1.f / sum` as rcp.approx, 2: as div.full), row sums in its
# per-thread order; 0 and tl.sum: what the interpreter runs.
@pytest.mark.parametrize("math, thread_sums", [(1, True), (2, True), (0, False)])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (32, 8, 128), (2, 1, 32)])
def test_the_fa3_rounded_fixup_compiles_within_shared_memory(
    math, thread_sums, dtype, heads, kv_heads, head_dim
):
    types = dict(Q=f"*{dtype}", K=f"*{dtype}", V=f"*{dtype}", Out=f"*{dtype}")
    types.update(BlockTable="*i32", QueryStart="*i32", SeqLens="*i32", Counters="*i32")
    types.update(Ancestors="*i64", NeedsFix="*i64", scale_log2="fp32", lse_scale="fp32")
    types.update(PartOut="*fp32", PartLse="*fp32")
    group = heads // kv_heads
    block_n = tree_attention_fa3.fa3_block_n(head_dim)
    constexprs = dict(
        GROUP=group,
        GROUP_PAD=triton.next_power_of_2(group),
        HEAD_DIM=head_dim,
        PAGE=16,
        ROWS=triton.next_power_of_2(17),
        WIN=triton.next_power_of_2(17 + 15),
        BLOCK_N=block_n,
        SUB=tree_attention_fa3.FA3_KEY_SUB,
        NUM_SPLITS=tree_attention_fa3.FA3_SPLITS,
        MATH=math,
        THREAD_SUMS=thread_sums,
    )
    kernel = compiled(tree_attention_fa3.tree_rows_attention_fa3, types, constexprs, num_warps=8)
    assert kernel.asm["cubin"] and kernel.metadata.shared <= H200_SHARED


def test_the_kv_move_compiles():
    types = dict(CachePtrs="*i64", SlotMapping="*i64", QueryStart="*i32", Paths="*i64")
    types["NumAccepted"] = "*i64"
    constexprs = dict(PAGE=16, KV_HEADS=8, HEADS_PAD=8, ROW=256, ROW_PAD=256, DTYPE=tl.bfloat16)
    assert compiled(kv_move._move_paths, types, constexprs).asm["cubin"]


# (hidden, GRU, correction rank): the released Qwen3-4B drafter's, the shipped SmolLM2's
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("hidden, gru, rank", [(2560, 1024, 256), (576, 256, 48)])
def test_the_domino_step_compiles(dtype, hidden, gru, rank, tmp_path):
    precision = "ieee" if dtype == "fp32" else "tf32"
    k = domino_step.gru_k_block(torch.float32 if dtype == "fp32" else torch.bfloat16)
    tiles = dict(ROWS=domino_step.ROWS_BLOCK, UNITS=domino_step.UNITS_BLOCK, K=k)
    rows = dict(Tokens="*i64", Req="*i64", Parent="*i64", Node="*i64", Depth="*i64")
    weights = dict(Embed=f"*{dtype}", States=f"*{dtype}", W_ih=f"*{dtype}", W_hh=f"*{dtype}")
    weights.update(Partials="*fp32", Counters="*i32", W_s=f"*{dtype}", UShares="*fp32")
    weights.update(Cand="*i64", GI=f"*{dtype}")
    e_pad = max(16, triton.next_power_of_2(rank))
    # the reduction whole, and split with a counted merge; with and without the table
    for splits, table in itertools.product((1, 4), (False, True)):
        widths = dict(
            H_SPLIT=domino_step.split_width(hidden, splits, k),
            G_SPLIT=domino_step.split_width(gru, splits, k),
        )
        constexprs = dict(H=hidden, G=gru, E=rank, E_PAD=e_pad, PRECISION=precision)
        constexprs.update(SPLITS=splits, M=64, M_PAD=64, FROM_TABLE=table, **widths)
        gru_step = compiled(
            domino_step._gru_step,
            {**rows, **weights},
            {**constexprs, **tiles},
            num_warps=domino_step.GRU_WARPS,
        )
        assert gru_step.asm["cubin"] and gru_step.metadata.shared <= H200_SHARED
        # its products' tiles stay in registers (K_BLOCK and GRU_WARPS chosen for it)
        usage = ptxas_usage(gru_step.asm["ptx"], tmp_path)
        assert "0 bytes spill stores, 0 bytes spill loads" in usage, (splits, table, usage)
    # The children alone (the host heap's call) and ending with the builder's pop, for
    # budget 16 with 16 children and budget 64 with 4; u from the GRU step's shares.
    types = dict(rows, UShares="*fp32", HidPart=f"*{dtype}", U="*fp32")
    types.update(ProjRows=f"*{dtype}", Base=f"*{dtype}", Cand="*i64")
    types.update(Values="*fp64", Expand="*i1", Trees="*i64", Parents="*i64", Depths="*i64")
    types.update(Scores="*fp64", ChildLogprobs="*fp64", ChildTokens="*i64", NextRank="*i64")
    types.update(PushSeq="*i64", Count="*i64", SpineTip="*i64", Branches="*i64")
    types.update(RecordSeq="*i64")
    types.update(PopSeq="*i64", OutNode="*i64", OutParent="*i64", OutToken="*i64")
    types.update(OutDepth="*i64", OutExpand="*i1")
    e_step = min(domino_step.E_BLOCK, triton.next_power_of_2(rank))
    for pop, budget, children in ((False, 16, 16), (True, 16, 16), (True, 64, 4)):
        width = triton.next_power_of_2(budget + 2)  # the tree's slots and the scratch slot
        constexprs = dict(
            E=rank, E_PAD=e_pad, UNIT_BLOCKS=triton.cdiv(gru, domino_step.UNITS_BLOCK)
        )
        constexprs.update(M=64, C=children, M_PAD=64, C_PAD=children, E_STEP=e_step)
        constexprs.update(POP=pop, WIDTH=width)
        kernel = compiled(domino_step._children, types, constexprs)
        assert kernel.asm["cubin"] and kernel.metadata.shared <= H200_SHARED


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (32, 8, 128)])
def test_the_merged_tree_part_compiles_without_spills(dtype, heads, kv_heads, head_dim, tmp_path):
    """one-pass-merge's kernel (kernels/tree_merge.py) at Qwen3-4B's and SmolLM2's heads:
    its [group, key tile, head dim] products stay in registers."""
    group = heads // kv_heads
    types = dict(
        Q=f"*{dtype}",
        K=f"*{dtype}",
        V=f"*{dtype}",
        PrefixOut=f"*{dtype}",
        PrefixLse="*fp32",
        Ancestors="*i64",
        Offset="*i64",
        Out=f"*{dtype}",
        scale_log2="fp32",
    )
    constexprs = dict(
        GROUP=group,
        GROUP_P2=triton.next_power_of_2(group),
        HEAD_DIM=head_dim,
        KEY_TILE=tree_merge.KEY_TILE,
    )
    kernel = compiled(tree_merge._tree_part_merged, types, constexprs)
    assert kernel.asm["cubin"]
    usage = ptxas_usage(kernel.asm["ptx"], tmp_path)
    assert "0 bytes spill stores, 0 bytes spill loads" in usage, usage
    print(f"heads {heads}/{kv_heads} x {head_dim}: {usage}")


def ptxas_usage(ptx: str, folder) -> str:
    """What the ptxas of Triton's wheel reports for a kernel (registers, spills)."""
    ptxas = get_ptxas(H200.arch).path  # the one Triton compiled the cubin with
    source = folder / "kernel.ptx"
    source.write_text(ptx)
    out = subprocess.run(
        [str(ptxas), "-arch=sm_90a", "-v", str(source), "-o", str(folder / "kernel.cubin")],
        capture_output=True,
        text=True,
        check=True,
    )
    return " ".join(line.split("info    : ")[-1].strip() for line in out.stderr.splitlines())


@pytest.mark.parametrize("width", [5, 17, 65])  # CPU's budget 4, CUDA's 16, budget 64
def test_the_fused_acceptance_compiles_without_spills(width, tmp_path):
    types = {name: "*i64" for name in tree_accept._accept_request.arg_names}
    types |= dict(Sampled="*i32", Accepted="*i8", num_logits="i32", W="i32")
    constexprs = dict(BLOCK=tree_accept.block_for(width))
    kernel = compiled(tree_accept._accept_request, types, constexprs)
    usage = ptxas_usage(kernel.asm["ptx"], tmp_path)
    assert "0 bytes spill stores, 0 bytes spill loads" in usage, usage
    print(f"width {width}: {usage}")
