"""The drafter's query pass as one CUDA graph per padded request count (CUDA, TP=1).

vLLM's V1 runner gives drafters piecewise graphs only: DFlash's query pass (block_size
tokens per request, non-causal over the context already in the drafter's KV cache) runs
as six graph pieces with the attention layers launched eagerly between them, and that
host work was most of the drafting stage on the H200 (3.2 ms traced per step at batch 1,
benchmarks/results/h200_2026-12-02_async). The pass is a uniform batch in every step,
prefill steps included, so it can be one graph, as vLLM's V2 runner captures it
(vllm/v1/worker/gpu/spec_decode/dflash/cudagraph.py).

A replay reads only fixed addresses: the proposer's input ids, positions and query slot
buffers (vLLM's fused input kernel writes them each step), the query starts (fixed per
size), the pass's sequence lengths (copied here each step), the runner's block table
rows, and whatever persistent buffers the attention metadata builder refreshes when the
metadata is built again each step. Padded requests read their own block only (sequence
length = block) and write their K/V nowhere (PADDING_SLOT_ID).

Not used (the proposer runs vLLM's piecewise pass, and counts it) under tensor
parallelism (the layers' collectives would need vLLM's graph-capture context), for a
batch beyond the captured sizes, and with DOMINOTREE_DRAFT_GRAPHS=0.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from vllm.config import CUDAGraphMode
from vllm.forward_context import set_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode.utils import PADDING_SLOT_ID

from ..cuda_graphs import capture
from ..tree.scorers import padded_rows


def draft_graphs_enabled() -> bool:
    return os.environ.get("DOMINOTREE_DRAFT_GRAPHS", "1") != "0"


class DraftGraphs:
    def __init__(
        self,
        proposer,  # the DominoTreeProposer (vLLM's DFlash proposer underneath)
        block_table: Callable[[int], torch.Tensor],  # rows -> the runner's first block rows
        max_requests: int,
    ):
        self.proposer = proposer
        self.block = proposer.spec.block_size
        self.block_table = block_table
        self.max_requests = max_requests
        device = proposer.device
        self.query_start = torch.arange(max_requests + 1, device=device, dtype=torch.int32)
        self.query_start *= self.block
        self.seq_lens = torch.full((max_requests,), self.block, device=device, dtype=torch.int32)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._metadata_of: dict[int, CommonAttentionMetadata] = {}

    def _metadata(self, p: int) -> CommonAttentionMetadata:
        """The query pass of p padded requests over the fixed buffers (the same object
        for every step of that size: only the buffers' contents change)."""
        if p not in self._metadata_of:
            self._metadata_of[p] = self._new_metadata(p)
        return self._metadata_of[p]

    def _new_metadata(self, p: int) -> CommonAttentionMetadata:
        proposer, block = self.proposer, self.block
        return CommonAttentionMetadata(
            query_start_loc=self.query_start[: p + 1],
            query_start_loc_cpu=torch.arange(p + 1, dtype=torch.int32) * block,
            seq_lens=self.seq_lens[:p],
            seq_lens_cpu_upper_bound=torch.full((p,), proposer.max_model_len, dtype=torch.int32),
            num_reqs=p,
            num_actual_tokens=p * block,
            max_query_len=block,
            max_seq_len=proposer.max_model_len,  # the bound every replay stays under
            block_table_tensor=self.block_table(p),
            slot_mapping=proposer._slot_mapping_buffer[: p * block],
            causal=proposer.dflash_causal,
        )

    def _refresh(self, p: int) -> dict:
        """The attention metadata of the pass for p requests, built on the host outside
        any capture (builders may also refresh buffers of their own, such as a kernel
        block table: the graphs read those too)."""
        return self.proposer.build_per_group_and_layer_attn_metadata(self._metadata(p))[1]

    def _forward(self, p: int, per_layer: dict) -> torch.Tensor:
        """The query pass over the buffers' first p requests, [p * block, H]."""
        proposer, num_tokens = self.proposer, p * self.block
        with set_forward_context(
            per_layer,
            proposer.vllm_config,
            num_tokens=num_tokens,
            cudagraph_runtime_mode=CUDAGraphMode.NONE,
            slot_mapping=proposer._get_slot_mapping(num_tokens),
        ):
            return proposer.model(
                input_ids=proposer.input_ids[:num_tokens],
                positions=proposer._get_positions(num_tokens),
                inputs_embeds=None,
            )

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per padded request count, at engine start (no request waits for a
        capture). Nothing is written to the cache meanwhile: every slot is padding."""
        sizes = sorted({padded_rows(n, self.max_requests) for n in range(1, self.max_requests + 1)})
        slots = self.proposer._slot_mapping_buffer
        slots[: sizes[-1] * self.block].fill_(PADDING_SLOT_ID)
        self.seq_lens.fill_(self.block)
        pool = None
        for p in reversed(sizes):  # the largest first: later graphs reuse its pool
            per_layer = self._refresh(p)
            self._forward(p, per_layer)  # compiles and warms the shape outside the capture
            graph = torch.cuda.CUDAGraph()
            with capture(graph, pool=pool):
                rows = self._forward(p, per_layer)
            pool = graph.pool()
            self._graphs[p] = (graph, rows)

    def serves(self, num_reqs: int) -> bool:
        return padded_rows(num_reqs, self.max_requests) in self._graphs

    def run(self, seq_lens: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """The step's query pass by a replay. seq_lens: [R] the pass's sequence lengths;
        slot_mapping: [R * block] its slots (the input kernel's, in the proposer's
        buffer). Returns the rows, [R * block, H]."""
        num_reqs = seq_lens.shape[0]
        p = padded_rows(num_reqs, self.max_requests)
        graph, rows = self._graphs[p]
        self.seq_lens[:num_reqs].copy_(seq_lens)
        self.seq_lens[num_reqs:p].fill_(self.block)
        self.proposer._get_slot_mapping(p * self.block, slot_mapping)  # pads with no slot
        self._refresh(p)
        graph.replay()
        return rows[: num_reqs * self.block]
