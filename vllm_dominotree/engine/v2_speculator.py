"""DominoTree's drafting on vLLM's Model Runner V2: its DFlash speculator with the
plugin's scorer in place of DFlash's sampling.

The V2 runner drafts with `DFlashSpeculator` (vllm/v1/worker/gpu/spec_decode/dflash/):
one Triton kernel lays out every request's context and query block, one drafter pass
(one FULL CUDA graph on CUDA) runs the block, and the drafts go into the runner's
request state on the device, so that nothing waits on the host. This subclass keeps all
of that and changes two things:
- the query block is the drafter's own block (`block_size` slots: the bonus token and
  block_size - 1 masks), as in the V1 proposer (proposer.py);
- `_generate_draft` (the function the drafter's graph records) drafts Domino's chain:
  the block's rows and their marginal logits prepare the scorer, then the released
  chain decoder (tree/scorers.py: GRU over the drafted tokens, corrected argmax) runs
  from each request's bonus token. A plain DFlash checkpoint drafts its marginal argmax.
Its drafts are deterministic, so `draft_logits` is None: vLLM's rejection sampler then
accepts a draft x with the target's probability of x, which keeps sampled output the
target's own.
Trees (scorers "conditional" and "marginal") are not ported yet: docs/v2-runner-port.md.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

from ..config import DominoTreeConfig
from ..drafter.checkpoint import read_spec
from ..drafter.model import DominoHead
from ..speculative import ADDITIONAL_CONFIG_KEY
from ..tree.scorers import make_scorer


class DominoChainSpeculator(DFlashSpeculator):
    _speculator_name = "DominoTree chain"

    def __init__(self, vllm_config, device: torch.device):
        super().__init__(vllm_config, device)
        self.options = DominoTreeConfig(**vllm_config.additional_config[ADDITIONAL_CONFIG_KEY])
        self.spec = read_spec(self.draft_model_config.model)
        self.shape = self.options.tree_shape(self.spec.num_drafts)  # one block, one child
        self.num_query_per_req = self.spec.block_size
        self.draft_logits = None  # deterministic drafts (module docstring)
        self.scorer = None

    def load_model(self, target_model: torch.nn.Module) -> None:
        super().load_model(target_model)
        head = None
        if self.spec.is_domino:
            tensors = {k: v.to(self.device) for k, v in self.model.domino_tensors.items()}
            head = DominoHead(self.spec, tensors)
        self.scorer = make_scorer(
            "chain",
            head,
            self.model.full_vocab_embedding(self.vllm_config.model_config.get_vocab_size()),
            shape=self.shape,
            candidates=self.options.candidates,
            prefix_len=self.spec.pure_draft_prefix_len,
            max_requests=self.max_num_reqs,
        )

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
        logits = self.model.compute_logits(rows.reshape(num_reqs * depth, -1))
        self.scorer.prepare(rows, logits.view(num_reqs, depth, -1))
        drafts, _ = self.scorer.chain(anchors)  # [R, depth]
        self.draft_tokens[:num_reqs, :depth] = drafts
