"""The DominoTree proposer: one drafter backbone pass per step, one tree per request.

It is vLLM's DFlash proposer (context K/V from the target's aux hidden states, paged
drafter KV cache, non-causal query block) with two differences:
- the query block is the drafter's own block (`block_size` slots: the bonus token and
  block_size - 1 masks), not 1 + num_speculative_tokens slots, because the verification
  budget is a tree size, not a block length;
- instead of sampling one token per mask slot it builds a best-first tree per request
  from the block's hidden rows and returns the nodes' tokens in topological order, as a
  device tensor: vLLM puts them into the next step's input ids on the device, and the
  runner describes that step from the builder's table (tree_step.py), so no one waits
  for the trees (vLLM's asynchronous scheduling runs a step ahead, as for DFlash).

On one GPU the drafter's logits and the scorer's preparation are the build's first stage,
inside its graph (DOMINOTREE_PREPARE_IN_BUILD=0 runs them eagerly before it, as under
tensor parallelism and on CPU).
"""

from __future__ import annotations

import os

import torch
from vllm.forward_context import set_forward_context
from vllm.v1.spec_decode.dflash import DFlashProposer

from ..config import DominoTreeConfig
from ..drafter.checkpoint import read_spec
from ..speculative import ADDITIONAL_CONFIG_KEY
from ..stage_clock import DraftBuildTimes
from ..tree.ancestry import TOKEN
from ..tree.builder import TreeShape, build_trees
from ..tree.device_builder import DeviceTreeBuilder
from ..tree.scorers import padded_rows
from .draft_graphs import DraftGraphs, draft_graphs_enabled
from .drafter_model import drafter_scorer

# The most the build's graph pool may keep for the drafter's logits ([rows x depth, vocab]
# of its largest padded batch); larger batches prepare the scorer before the build.
PREPARE_IN_BUILD_BYTES = 512 << 20


def prepare_in_build_enabled() -> bool:
    return os.environ.get("DOMINOTREE_PREPARE_IN_BUILD", "1") != "0"


class DominoTreeProposer(DFlashProposer):
    def __init__(self, vllm_config, device: torch.device, runner):
        super().__init__(vllm_config, device, runner)
        self.options = DominoTreeConfig(**vllm_config.additional_config[ADDITIONAL_CONFIG_KEY])
        self.spec = read_spec(self.draft_model_config.model)
        self.shape = self.options.tree_shape(self.spec.num_drafts)
        self.budget = self.shape.budget  # verification rows per request - 1
        # Slots vLLM reserves per request: >= the drafter's block (speculative.py).
        self.reserved = self.num_speculative_tokens
        self.scorer = None
        self.builder: DeviceTreeBuilder | None = None
        self.clock = runner.stage_clock  # the tree runner's: one clock per step
        # Each step's draft and build seconds, read by the runner once the GPU is past them.
        self.times = DraftBuildTimes(device)
        # CUDA: the query pass as one graph per padded batch (draft_graphs.py); its
        # replays and vLLM's piecewise passes are counted.
        self.draft_graphs: DraftGraphs | None = None
        self.graph_drafts = 0
        self.eager_drafts = 0
        # The rows the build prepares the scorer from, when it does ([R, K, H]).
        self.step_hidden: torch.Tensor | None = None

    def load_model(self, target_model: torch.nn.Module) -> None:
        # The drafter was checked against the target in process 0 (patches/engine_args.py).
        super().load_model(target_model)
        self.scorer = drafter_scorer(
            self.model,
            self.vllm_config,
            self.spec,
            self.options,
            self.shape,
            self.max_batch_size,
            self.device,
        )
        # CUDA: the device builder, one captured graph per build (with the scorer's
        # preparation in it on one GPU). CPU: the host heap for trees, the device
        # builder's reference (same trees, tests/test_tree_builder.py): without graphs
        # the fixed-shape pops cost more torch calls than the heap's
        # (benchmarks/results/cpu_builder_choice.md); the chain is the scorer's unrolled
        # decoder on both.
        prepare_rows = self._prepare_in_build_rows()
        if prepare_rows:
            self.step_hidden = torch.zeros(
                self.max_batch_size,
                self.shape.max_depth,
                self.hidden_size,
                dtype=self.dtype,
                device=self.device,
            )
        self.builder = DeviceTreeBuilder(
            self.scorer,
            self.shape,
            chain=self.options.scorer == "chain",
            max_requests=self.max_batch_size,
            device=self.device,
            table_width=self.reserved + 1,  # vLLM may schedule up to `reserved` drafts
            prepare=self._prepare_from_step_hidden if prepare_rows else None,
            prepare_rows=prepare_rows,
        )

    def _prepare_in_build_rows(self) -> int:
        """The largest padded batch whose build prepares the scorer itself (0: none):
        CUDA on one GPU, its logits within PREPARE_IN_BUILD_BYTES."""
        from vllm.distributed import get_tensor_model_parallel_world_size

        if (
            self.device.type != "cuda"
            or get_tensor_model_parallel_world_size() > 1
            or not prepare_in_build_enabled()
        ):
            return 0
        head = self.model.draft_head
        vocab = self.vllm_config.model_config.get_vocab_size() if head is None else len(head)
        per_request = self.shape.max_depth * vocab * self.dtype.itemsize
        r = self.max_batch_size
        sizes = {padded_rows(n, r) for n in range(1, r + 1)}
        return max((p for p in sizes if p * per_request <= PREPARE_IN_BUILD_BYTES), default=0)

    def _prepare_from_step_hidden(self, p: int) -> None:
        """The build's first stage: the scorer prepared from step_hidden's first p rows."""
        hidden = self.step_hidden[:p]
        self.scorer.prepare(hidden, self._logits(hidden))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The drafter's marginal logits of its rows: [R, K, H] -> [R, K, V or S]."""
        r, k, _ = hidden.shape
        return self.model.draft_logits(hidden.reshape(r * k, -1)).view(r, k, -1)

    def capture_builder(self) -> None:
        """The builder's CUDA graphs, one per padded batch size (the runner calls this
        while vLLM captures its own)."""
        self.builder.capture()

    def capture_query_pass(self, block_table) -> None:
        """The query pass's CUDA graphs (draft_graphs.py), unless turned off or under
        tensor parallelism. block_table: rows -> the runner's block table rows of the
        drafter's KV cache group."""
        from vllm.distributed import get_tensor_model_parallel_world_size

        if not draft_graphs_enabled() or get_tensor_model_parallel_world_size() > 1:
            return
        self.draft_graphs = DraftGraphs(self, block_table, self.max_batch_size)
        self.draft_graphs.capture()

    def _build(self, anchors: torch.Tensor, shape: TreeShape) -> None:
        """The trees into the builder's table (marking BUILT when they are queued); shape:
        the step's (builder.step_shape), which the host heap takes."""
        if self.device.type == "cuda" or self.builder.chain:
            self.builder.launch(anchors)
        else:
            self.builder.counts.eager_builds += 1
            self.builder.store(build_trees(self.scorer, anchors.tolist(), shape))
        self.times.mark(self.times.BUILT)

    @torch.inference_mode()
    def propose(
        self,
        num_speculative_tokens: int,
        target_token_ids: torch.Tensor,  # [T] all scheduled rows (context)
        target_positions: torch.Tensor,  # [T]
        target_hidden_states: torch.Tensor,  # [T, n_ids * H] aux hidden states
        next_token_ids: torch.Tensor,  # [R] the bonus token of each request (anchor)
        token_indices_to_sample: torch.Tensor | None,
        common_attn_metadata,
        sampling_metadata,
        mm_embed_inputs=None,
        num_rejected_tokens_gpu: torch.Tensor | None = None,
        slot_mappings=None,
    ) -> torch.Tensor:
        """[R, b] each tree's drafted tokens in topological order, slots without a node
        as token 0 (the verification step knows them from the table and never accepts
        them); b the budget, or the step's share of step_nodes, vLLM then schedules b
        drafts a request (CPU: synchronous scheduling)."""
        times = self.times
        times.mark(times.DRAFT)
        with self.clock.stage("draft"):
            hidden = self._draft(
                target_token_ids,
                target_positions,
                target_hidden_states,
                next_token_ids,
                token_indices_to_sample,
                common_attn_metadata,
                mm_embed_inputs,
                num_rejected_tokens_gpu,
            )
        times.mark(times.DRAFTED)
        num_reqs = next_token_ids.shape[0]
        shape = self.builder.step_shape(num_reqs)  # its budget: the drafts vLLM schedules
        with self.clock.stage("build"):  # the logits, the scorer's preparation, the build
            if self.builder.prepares(num_reqs):
                self.step_hidden[:num_reqs].copy_(hidden)  # where the build's graph reads
            else:
                self.scorer.prepare(hidden, self._logits(hidden))
            self._build(next_token_ids, shape)
        self.times.close()
        # A new tensor: vLLM keeps it (and may copy it to the host) past the next build.
        return self.builder.table[TOKEN, :num_reqs, 1 : shape.budget + 1].clamp(min=0)

    def _draft(
        self,
        target_token_ids,
        target_positions,
        target_hidden_states,
        next_token_ids,
        token_indices_to_sample,
        common_attn_metadata,
        mm_embed_inputs,
        num_rejected_tokens_gpu,
    ) -> torch.Tensor:
        """One backbone pass over every request's block: the rows that predict drafts
        0..K-1, [R, K, H], K the deepest a tree can reach (the drafter's drafts per
        block, or fewer under a small budget)."""
        num_reqs = common_attn_metadata.batch_size()
        context = self.model.combine_hidden_states(target_hidden_states)
        # The query block is block_size slots: the bonus and block_size - 1 masks.
        self.num_speculative_tokens = self.spec.block_size - 1
        try:
            num_tokens, _, cad = self.set_inputs_first_pass(
                target_token_ids=target_token_ids,
                next_token_ids=next_token_ids,
                target_positions=target_positions,
                target_hidden_states=context,
                token_indices_to_sample=token_indices_to_sample,
                cad=common_attn_metadata,
                num_rejected_tokens_gpu=num_rejected_tokens_gpu,
            )
        finally:
            self.num_speculative_tokens = self.reserved
        graphs = self.draft_graphs
        if graphs is not None and graphs.serves(num_reqs):
            # The context's K/V go into the drafter's cache first (not in the graph: its
            # row count varies), then one replay runs the query pass.
            self.build_model_inputs_first_pass(num_tokens, num_tokens, mm_embed_inputs)
            block_rows = graphs.run(cad.seq_lens, cad.slot_mapping)
            self.graph_drafts += 1
        else:
            block_rows = self._piecewise_query_pass(num_tokens, cad, mm_embed_inputs)
            self.eager_drafts += 1

        first, k = self.spec.first_draft_slot, self.shape.max_depth
        return block_rows.view(num_reqs, self.spec.block_size, -1)[:, first : first + k]

    def _piecewise_query_pass(self, num_tokens: int, cad, mm_embed_inputs) -> torch.Tensor:
        """vLLM's own query pass (piecewise graphs on CUDA, eager on CPU), [T, H]."""
        _, per_layer_metadata = self.build_per_group_and_layer_attn_metadata(cad)
        cudagraph_mode, num_input_tokens, num_tokens_across_dp = (
            self._determine_batch_execution_and_padding(num_tokens)
        )
        model_kwargs, slot_mapping_size = self.build_model_inputs_first_pass(
            num_tokens, num_input_tokens, mm_embed_inputs
        )
        with set_forward_context(
            per_layer_metadata,
            self.vllm_config,
            num_tokens=num_input_tokens,
            num_tokens_across_dp=num_tokens_across_dp,
            cudagraph_runtime_mode=cudagraph_mode,
            slot_mapping=self._get_slot_mapping(slot_mapping_size, cad.slot_mapping),
        ):
            return self.model(**model_kwargs)[:num_tokens]
