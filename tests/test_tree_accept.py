"""The fused acceptance kernel (kernels/tree_accept.py, CUDA's accept stage) under
Triton's interpreter against the torch reference it replaces (engine/acceptance.py's
accept_trees and step_counters), on random steps: trees with many matching siblings,
one-row requests beside them, rows scheduled past a tree, and the padded shape the
accept graphs replay (spare requests, rows of no tree past the step's)."""

from __future__ import annotations

from interpreter import run_interpreted


def test_the_kernel_gives_the_reference_results():
    run_interpreted("""
import torch
from acceptance_cases import random_step
from vllm_dominotree.engine.acceptance import accept_trees, step_counters
from vllm_dominotree.kernels.tree_accept import accept_requests

def kernel(step, target, last_rows, width):
    fields = (step.parent_row, step.token, step.ancestors, step.siblings_before,
              step.offset, step.depth, step.in_tree)
    return accept_requests(*fields, target, last_rows, width)

checked = moved = 0
for seed in range(12):
    for width in (13, 17):
        step, _, target, last_rows, _ = random_step(seed, buffers=None)
        want = accept_trees(step, target, last_rows, 7, width)
        want_counters = step_counters(step, want)
        sampled, path, num_accepted, accepted, counters = kernel(step, target, last_rows, width)
        assert torch.equal(sampled, want.sampled), (seed, sampled, want.sampled)
        assert torch.equal(path, want.path_offsets)
        assert torch.equal(num_accepted, want.num_accepted)
        assert torch.equal(accepted, want.accepted)
        assert torch.equal(counters, want_counters), (counters, want_counters)
        checked += int(want.num_accepted.sum())
        moved += int(want_counters[2])
assert checked > 20 and moved > 0, (checked, moved)

# The graphs' shape: 4 spare requests (last row 0) and the rows of no tree past the step.
from vllm_dominotree.engine.tree_step import TreeStepBuffers
buffers = TreeStepBuffers(256, torch.device("cpu"))
step, _, target, last_rows, _ = random_step(3, buffers=buffers)
padded = buffers.view(0, 11 * 13)
rows = torch.zeros(11, dtype=torch.long)
rows[:7] = last_rows
tokens = torch.zeros(256, dtype=torch.long)
tokens[: target.shape[0]] = target
want = accept_trees(padded, tokens, rows, 11, 13)
got = kernel(padded, tokens, rows, 13)
assert torch.equal(got[0][:7], want.sampled[:7]) and torch.equal(got[2], want.num_accepted)
assert torch.equal(got[3], want.accepted) and torch.equal(got[4], step_counters(padded, want))
assert int(got[2][7:].sum()) == 0
print("ok")
""")
