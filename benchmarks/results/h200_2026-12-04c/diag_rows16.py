"""Which configurations of the FA3-rounded fix-up fail on trees of 16 rows or fewer (run
once on the H200, 2026-12-04c, before the kernel's 32-row floor; kept with its results).

    python3 benchmarks/results/h200_2026-12-04c/diag_rows16.py OUT.txt

Each case runs in its own process (an illegal memory access spoils the CUDA context)
with CUDA_LAUNCH_BLOCKING=1, against FA3 called as vLLM's backend decodes.
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

SHAPES = ("smollm2-135m", "qwen3-4b")


def child(shape, data_rows, kernel_rows, context, seed, math_, ts, bb, decode_only) -> str:
    import torch

    sys.path.insert(0, "tests")
    from tree_attention_check import (
        ATTENTION_SHAPES,
        bf16_case,
        decode_batch_blocks,
        vllm_decode_output,
    )

    from vllm_dominotree.kernels.tree_attention import TreeAttention
    from vllm_dominotree.kernels.tree_attention_fa3 import fa3_block_n

    heads, _, head_dim = ATTENTION_SHAPES[shape]
    args = bf16_case(shape, seed, context, data_rows)
    fixed = args[-1].bool()
    decode = vllm_decode_output(args)
    torch.cuda.synchronize()
    if decode_only:
        return "decode ok"
    kernel = TreeAttention(heads, head_dim, kernel_rows, torch.device("cuda"), rounds_as="fa3")
    kernel.fa3_math, kernel.fa3_thread_sums = math_, bool(ts)
    got = torch.full_like(args[0], 7.0)
    blocks = decode_batch_blocks(args, fa3_block_n(head_dim)) if bb else 0
    kernel(*args, head_dim**-0.5, got, blocks)
    torch.cuda.synchronize()
    return f"ok differing {(got[fixed] != decode[fixed]).float().mean().item():.6f}"


def cases() -> list[dict]:
    found = []
    for shape in SHAPES:
        for seed in (0, 1):
            base = dict(shape=shape, data_rows=16, kernel_rows=16, context=300, seed=seed)
            base.update(math_=1, ts=1, bb=1, decode_only=False)
            found += [
                {**base, "decode_only": True},
                base,
                {**base, "math_": 0},
                {**base, "ts": 0},
                {**base, "math_": 0, "ts": 0},
                {**base, "bb": 0},
                {**base, "kernel_rows": 17},
                {**base, "data_rows": 17, "kernel_rows": 17},
                {**base, "data_rows": 8, "kernel_rows": 8},
                {**base, "context": 1100},
                {**base, "context": 1100, "kernel_rows": 17},
            ]
    return found


def run(case: dict) -> tuple[dict, str]:
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    command = [sys.executable, __file__, "child", json.dumps(case)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    return case, lines[-1] if lines else f"NO RESULT rc={done.returncode} {done.stderr[-300:]}"


if __name__ == "__main__":
    if sys.argv[1] == "child":
        try:
            print("RESULT", child(**json.loads(sys.argv[2])))
        except Exception as error:
            print("RESULT FAIL", type(error).__name__, str(error).splitlines()[0][:150])
        sys.exit(0)
    with ThreadPoolExecutor(8) as pool, open(sys.argv[1], "w") as out:
        for case, result in pool.map(run, cases()):
            print(f"{json.dumps(case)} -> {result}", file=out, flush=True)
