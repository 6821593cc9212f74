"""Random verification steps for the acceptance tests (CPU and GPU)."""

from __future__ import annotations

import numpy as np
import torch

from vllm_dominotree.engine.tree_step import TreeRows, TreeStepBuffers
from vllm_dominotree.tree.ancestry import NUM_FIELDS, describe_slots, in_preorder
from vllm_dominotree.tree.builder import DraftTree
from vllm_dominotree.tree.device_builder import slot_tensors

SLOTS = 13  # random trees have at most 12 rows, one padding row beside


def random_tree(gen: torch.Generator, size: int, vocab: int) -> DraftTree:
    """A random tree numbered as verification steps number theirs (depth-first
    preorder, tree/ancestry.in_preorder), so that its node i is the step's row i."""
    tokens, parents = [int(torch.randint(vocab, (1,), generator=gen))], [-1]
    for i in range(1, size):
        parents.append(int(torch.randint(i, (1,), generator=gen)))
        tokens.append(int(torch.randint(vocab, (1,), generator=gen)))
    fields = (
        torch.tensor([tokens]),
        torch.tensor([parents]),
        torch.zeros(1, size, dtype=torch.long),
    )
    tokens, parents, _ = (f[0].tolist() for f in in_preorder(*fields))
    tree = DraftTree.root(tokens[0])
    for token, parent in zip(tokens[1:], parents[1:], strict=True):
        tree.add(token, parent, 0.0)
    return tree


def table_of(trees: list[DraftTree]) -> torch.Tensor:
    """The builder's table for these trees ([fields, trees + 1, SLOTS], as the device
    builder writes it; the extra row holds nothing)."""
    table = torch.zeros(NUM_FIELDS, len(trees) + 1, SLOTS, dtype=torch.long)
    describe_slots(*slot_tensors(trees, SLOTS), table[:, : len(trees)])
    return table


def random_step(seed: int, vocab: int = 3, buffers: TreeStepBuffers | None = None):
    """A batch of trees (small vocabulary: siblings share tokens, many rows match),
    with plain one-row requests between them and rows scheduled past the tree on some
    (slots without a node), published into `buffers` (new ones by default) from the
    trees' table."""
    gen = torch.Generator().manual_seed(seed)
    trees, host = [], []
    token_row = logits_row = 0
    logits_requests, logits_token_rows, query_start = [], [], []
    for r in range(7):
        query_start.append(token_row)
        if r % 3 == 1:  # a request without a tree (a prefill's last row)
            prefill = int(torch.randint(1, 5, (1,), generator=gen))
            logits_requests.append(r)
            token_row += prefill
            logits_token_rows.append(token_row - 1)
            logits_row += 1
            continue
        tree = random_tree(gen, int(torch.randint(1, 12, (1,), generator=gen)), vocab)
        pad = r % 2
        t = TreeRows(r, token_row, logits_row, 100 + r, tree.num_nodes + pad, len(host))
        trees.append(t)
        host.append((r, tree))
        logits_requests += [r] * t.num_rows
        logits_token_rows += range(token_row, token_row + t.num_rows)
        token_row += t.num_rows
        logits_row += t.num_rows
    ends = np.cumsum(np.bincount(logits_requests, minlength=7))
    starts = np.concatenate([[0], ends[:-1]])
    buffers = buffers or TreeStepBuffers(128, torch.device("cpu"))
    step = buffers.publish(
        trees,
        token_row,
        np.array(logits_requests),
        list(zip(starts.tolist(), ends.tolist(), strict=True)),
        np.array(logits_token_rows),
        table_of([tree for _, tree in host]).to(buffers.device_rows.device),
    )
    target = torch.randint(vocab, (logits_row,), generator=gen)
    query_start = torch.tensor([*query_start, token_row])  # as vLLM's metadata holds it
    return step, host, target, torch.from_numpy(ends - 1), query_start
