"""vLLM's DFlash drafter model, also carrying Domino's GRU and correction weights.

vLLM 0.32's `DFlashQwen3ForCausalLM` loads the backbone (layers, fc, hidden_norm, norm)
into its paged-KV attention layers and shares the target's embedding and lm_head.
A Domino checkpoint adds `prefix_gru.*` and `embed_proj.*`, which that loader does not
know. This subclass takes them out of the weight stream, keeps them as tensors on the
model's device and dtype, and hands the rest to vLLM. The Domino head's math lives in
`drafter.model.DominoHead`, shared with the reference decoder.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

from ..config import node_step
from ..drafter.model import DominoHead
from ..tree.scorers import make_scorer

DOMINO_PREFIXES = ("prefix_gru.", "embed_proj.")


class DominoDraftForCausalLM(DFlashQwen3ForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.domino_tensors: dict[str, torch.Tensor] = {}
        self._dtype = vllm_config.model_config.dtype

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        device = self.lm_head.weight.device

        def backbone_only():
            for name, tensor in weights:
                if name.startswith(DOMINO_PREFIXES):
                    self.domino_tensors[name] = tensor.to(device=device, dtype=self._dtype)
                else:
                    yield name, tensor

        return super().load_weights(backbone_only())

    def full_vocab_embedding(self, vocab: int) -> torch.Tensor:
        """The target's embedding table over the whole vocabulary, [V, H]: the scorers
        embed drafted tokens of any id. Under tensor parallelism vLLM keeps one vocab
        shard per rank, so the shards are gathered once here (a copy of the table per
        rank; the alternative, vLLM's parallel lookup, costs a collective per pop)."""
        from vllm.distributed import get_tensor_model_parallel_world_size
        from vllm.distributed.communication_op import tensor_model_parallel_all_gather

        table = self.model.embed_tokens.weight
        if get_tensor_model_parallel_world_size() == 1:
            return table
        # Shards split the padded vocabulary evenly; the real ids come first.
        return tensor_model_parallel_all_gather(table.contiguous(), dim=0)[:vocab]


def drafter_scorer(
    model: DominoDraftForCausalLM,
    vllm_config,
    spec,
    options,
    shape,
    max_requests: int,
    device: torch.device,
):
    """The tree scorer (tree/scorers.py) over a loaded drafter: Domino's head from the
    checkpoint's GRU and correction weights (none for a plain DFlash checkpoint), the
    target's embedding over the whole vocabulary; the conditional scorer's Triton step
    with DOMINOTREE_NODE_STEP=triton (CUDA; refused on CPU at engine start), on either
    runner."""
    head = None
    if spec.is_domino:
        # vLLM may load weights before the model reaches its device.
        head = DominoHead(spec, {k: v.to(device) for k, v in model.domino_tensors.items()})
    return make_scorer(
        options.scorer,
        head,
        model.full_vocab_embedding(vllm_config.model_config.get_vocab_size()),
        shape=shape,
        candidates=options.candidates,
        prefix_len=spec.pure_draft_prefix_len,
        max_requests=max_requests,
        kernels=options.scorer == "conditional" and node_step() == "triton",
    )
