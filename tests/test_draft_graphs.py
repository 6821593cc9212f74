"""The drafter's query-pass graphs (engine/draft_graphs.py), replay side: what a replay
reads is in the fixed buffers before it, padded requests included. The capture itself
needs CUDA (tests/gpu/test_engine_gpu.py counts graph and piecewise drafts)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

from vllm_dominotree.engine.draft_graphs import DraftGraphs

BLOCK = 4


class StandInProposer:
    """What DraftGraphs reads of vLLM's DFlash proposer; the slot buffer is vLLM's own
    method on these buffers."""

    spec = SimpleNamespace(block_size=BLOCK)
    device = torch.device("cpu")
    max_model_len = 64
    dflash_causal = False
    _draft_attn_layer_names = ("drafter.layers.0.attn",)
    _get_slot_mapping = SpecDecodeBaseProposer._get_slot_mapping

    def __init__(self):
        self._slot_mapping_buffer = torch.arange(100, dtype=torch.int64)
        self.built = []  # the metadata each build was asked for

    def build_per_group_and_layer_attn_metadata(self, cad):
        self.built.append(cad)
        return [], {}


class CountingGraph:
    replays = 0

    def replay(self):
        self.replays += 1


def test_a_replay_reads_the_step_in_fixed_buffers_with_padded_requests_inert():
    proposer = StandInProposer()
    table = torch.arange(8 * 3, dtype=torch.int32).view(8, 3)
    graphs = DraftGraphs(proposer, lambda rows: table[:rows], max_requests=8)
    graph, out = CountingGraph(), torch.arange(4 * BLOCK * 2).view(4 * BLOCK, 2)
    graphs._graphs[4] = (graph, out)  # three requests replay the graph of four
    assert graphs.serves(3) and not graphs.serves(5)  # 5 pads to 8: not captured

    rows = graphs.run(torch.tensor([10, 11, 12], dtype=torch.int32), torch.arange(3 * BLOCK))
    assert graph.replays == 1 and torch.equal(rows, out[: 3 * BLOCK])
    assert graphs.seq_lens[:4].tolist() == [10, 11, 12, BLOCK]  # the padded one: its block
    slots = proposer._slot_mapping_buffer
    assert slots[: 3 * BLOCK].tolist() == list(range(3 * BLOCK))
    assert slots[3 * BLOCK : 4 * BLOCK].tolist() == [-1] * BLOCK  # writes nowhere
    cad = proposer.built[-1]  # the metadata refreshed before the replay
    assert cad.num_reqs == 4 and cad.num_actual_tokens == 4 * BLOCK
    assert cad.query_start_loc.tolist() == [0, 4, 8, 12, 16]
    assert cad.seq_lens.data_ptr() == graphs.seq_lens.data_ptr()
    assert cad.block_table_tensor.data_ptr() == table.data_ptr()
    assert cad.max_seq_len == proposer.max_model_len and cad.causal is False
    # A later step of that size replays the same graph over the same metadata.
    graphs.run(torch.tensor([20, 21, 22], dtype=torch.int32), torch.arange(3 * BLOCK))
    assert graph.replays == 2 and proposer.built[-1] is cad
    assert graphs.seq_lens[:4].tolist() == [20, 21, 22, BLOCK]
