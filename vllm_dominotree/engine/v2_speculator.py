"""DominoTree's drafting on vLLM's Model Runner V2: its DFlash speculator with the
plugin's scorer and tree builder in place of DFlash's sampling.

The V2 runner drafts with `DFlashSpeculator` (vllm/v1/worker/gpu/spec_decode/dflash/):
one Triton kernel lays out every request's context and query block, one drafter pass
(one FULL CUDA graph on CUDA) runs the block, and the drafts go into the runner's
request state on the device, so that nothing waits on the host. This subclass keeps all
of that and changes three things:
- the query block is the drafter's own block (`block_size` slots: the bonus token and
  block_size - 1 masks), as in the V1 proposer (proposer.py);
- `_generate_draft` (the function the drafter's graph records) prepares the scorer from
  the block's rows and their marginal logits, then drafts from each request's bonus
  token: Domino's chain (GRU over the drafted tokens, corrected argmax over the top-M
  candidates; a plain DFlash checkpoint's marginal argmax), or a best-first tree per request
  (on CUDA the device builder, recorded in DFlash's FULL graph with the draft; on CPU the
  host heap), whose nodes' tokens in topological order are the drafts;
- `propose` first lets the runner commit the last step's accepted paths (`commit`,
  v2_runner.py: the drafter's context rows reordered) and afterwards files each tree's
  table under its request's state slot (`state_table`): V2 re-sorts the batch every step,
  and the next step's verification reads the trees by slot.
The chain's drafts are deterministic, so `draft_logits` is None: vLLM's rejection sampler
then accepts a draft x with the target's probability of x, which keeps sampled output the
target's own. Trees are accepted by the runner's tree sampler (v2_sampler.py).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

from ..config import DominoTreeConfig
from ..drafter.checkpoint import read_spec
from ..speculative import ADDITIONAL_CONFIG_KEY
from ..tree.ancestry import TOKEN
from ..tree.builder import build_trees
from ..tree.device_builder import BuildCounts, DeviceTreeBuilder
from ..tree.scorers import padded_rows
from .drafter_model import drafter_scorer
from .tree_paths import stream_capturing


class DominoTreeSpeculator(DFlashSpeculator):
    _speculator_name = "DominoTree"

    def __init__(self, vllm_config, device: torch.device):
        super().__init__(vllm_config, device)
        self.options = DominoTreeConfig(**vllm_config.additional_config[ADDITIONAL_CONFIG_KEY])
        self.spec = read_spec(self.draft_model_config.model)
        self.shape = self.options.tree_shape(self.spec.num_drafts)
        self.chain = self.options.scorer == "chain"
        self.num_query_per_req = self.spec.block_size
        self.draft_logits = None  # deterministic drafts (module docstring)
        self.scorer = None
        self.builder: DeviceTreeBuilder | None = None
        # Tree tables by request-state slot ([fields, max_num_reqs + 1, slots]); the
        # last row is the builder's no-tree row. None for the chain.
        self.state_table: torch.Tensor | None = None
        # Set by the runner: commit(input_batch, aux_hidden_states), before drafting.
        self.commit: Callable[[Any, list[torch.Tensor] | None], None] | None = None
        # Set by the runner: its stage clock's stage(name), profiler ranges for benchmarks.
        self.stage: Callable[[str], AbstractContextManager] = lambda name: nullcontext()

    def load_model(self, target_model: torch.nn.Module) -> None:
        super().load_model(target_model)
        self.scorer = drafter_scorer(
            self.model,
            self.vllm_config,
            self.spec,
            self.options,
            self.shape,
            self.max_num_reqs,
            self.device,
        )
        if not self.chain:
            self.builder = DeviceTreeBuilder(
                self.scorer,
                self.shape,
                chain=False,
                max_requests=self.max_num_reqs,
                device=self.device,
                table_width=self.num_speculative_steps + 1,
            )
            no_tree = self.builder.table[:, self.builder.no_tree_row : self.builder.no_tree_row + 1]
            self.state_table = no_tree.repeat(1, self.max_num_reqs + 1, 1)

    def capture_builder(self) -> None:
        """The builder's own CUDA graphs, one per padded batch size, for the drafts vLLM
        runs outside its graphs (the runner calls this after vLLM's capture). Its build
        counts start here: they count the builds outside vLLM's graphs (those inside
        replay with them, unseen by the host), and a size without a graph is eager."""
        if self.builder is not None and self.device.type == "cuda":
            self.builder.capture()
            self.builder.counts = BuildCounts()

    @torch.inference_mode()
    def propose(
        self,
        input_batch,
        attn_metadata,
        slot_mappings,
        last_hidden_states,
        aux_hidden_states,
        *args,
        **kwargs,
    ) -> torch.Tensor:
        dummy = kwargs.get("dummy_run", False)
        if self.commit is not None and not dummy:
            with self.stage("commit"):
                self.commit(input_batch, aux_hidden_states)
        with self.stage("draft"):
            drafts = super().propose(
                input_batch,
                attn_metadata,
                slot_mappings,
                last_hidden_states,
                aux_hidden_states,
                *args,
                **kwargs,
            )
            if self.state_table is not None and not dummy:
                num_reqs = input_batch.num_reqs
                self.state_table[:, input_batch.idx_mapping[:num_reqs]] = self.builder.table[
                    :, :num_reqs
                ]
        return drafts

    def _generate_draft(
        self,
        num_reqs: int,
        num_tokens_padded: int,
        attn_metadata: dict[str, Any] | None,
        slot_mappings: dict[str, torch.Tensor] | None,
        num_tokens_across_dp: torch.Tensor | None,
        cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
    ) -> None:
        hidden = self._run_model(
            num_tokens_padded,
            attn_metadata,
            slot_mappings,
            num_tokens_across_dp,
            cudagraph_runtime_mode,
        )  # [R * block, H]: each request's query block, the bonus token first
        block, first, depth = (
            self.num_query_per_req,
            self.spec.first_draft_slot,
            self.shape.max_depth,
        )
        rows = hidden[: num_reqs * block].view(num_reqs, block, -1)[:, first : first + depth]
        anchors = self.input_buffers.input_ids[: num_reqs * block : block]  # [R] bonus tokens
        logits = self.model.draft_logits(rows.reshape(num_reqs * depth, -1))
        self.scorer.prepare(rows, logits.view(num_reqs, depth, -1))
        if self.chain:
            drafts, _ = self.scorer.chain(anchors)  # [R, depth]
            self.draft_tokens[:num_reqs, :depth] = drafts
            return
        if self.device.type == "cuda" and stream_capturing():
            # The device builder's body, so that DFlash's FULL graph records the draft and
            # the build as one replay (its warm-up runs compile the builder's functions).
            self.builder.anchors[:num_reqs].copy_(anchors)
            self.builder.grow(padded_rows(num_reqs, self.max_num_reqs))
        elif self.device.type == "cuda":
            # Outside vLLM's graphs (a batch past its capture sizes, as 64 requests of 16
            # query rows are at vLLM's default 512, or warm-up): the builder's own graph
            # for the size, one replay where the build's launches (two a pop, and its
            # start and finish) were host time that the eager forward around it already
            # waits on (capture_builder).
            self.builder.launch(anchors)
        else:  # the host heap: the same trees, fewer torch calls without graphs
            self.builder.counts.eager_builds += 1
            self.builder.store(
                build_trees(self.scorer, anchors.tolist(), self.builder.step_shape(len(anchors)))
            )
        budget = self.shape.budget
        nodes = self.builder.table[TOKEN, :num_reqs, 1 : budget + 1]  # topological order
        self.draft_tokens[:num_reqs, :budget] = nodes.clamp(min=0)  # -1: no node
