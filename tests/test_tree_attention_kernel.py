"""The Triton tree-attention kernel, run by Triton's interpreter on the CPU (the same
kernel runs compiled on the H200 in tests/gpu)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CHECK = """
import sys
sys.path.insert(0, {tests!r})
import torch
from tree_attention_check import max_error
# Long contexts take the slice + merge path, short ones (<= one slice) the direct one.
for seed, context in [(0, 1100), (1, 1100), (2, 1100), (3, 300), (4, 60)]:
    tree, other = max_error("cpu", torch.float32, seed, max_context=context)
    print(seed, context, tree, other)
    assert tree < 1e-4, (seed, tree)
    assert other == 0, (seed, other)
print("ok")
"""


def test_kernel_matches_dense_reference_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = CHECK.format(tests=str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert out.stdout.strip().endswith("ok")
