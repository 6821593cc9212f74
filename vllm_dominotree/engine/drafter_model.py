"""vLLM's DFlash drafter model, also carrying Domino's GRU and correction weights.

vLLM 0.32's `DFlashQwen3ForCausalLM` loads the backbone (layers, fc, hidden_norm, norm)
into its paged-KV attention layers and shares the target's embedding and lm_head.
A Domino checkpoint adds `prefix_gru.*` and `embed_proj.*`, which that loader does not
know. This subclass takes them out of the weight stream, keeps them as tensors on the
model's device and dtype, and hands the rest to vLLM. The Domino head's math lives in
`drafter.model.DominoHead`, shared with the reference decoder.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

from ..config import DominoTreeConfigError, node_step
from ..drafter.draft_vocab import draft_vocab_ids
from ..drafter.model import DominoHead
from ..tree.scorers import make_scorer

DOMINO_PREFIXES = ("prefix_gru.", "embed_proj.")


class DominoDraftForCausalLM(DFlashQwen3ForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.domino_tensors: dict[str, torch.Tensor] = {}
        self._dtype = vllm_config.model_config.dtype
        # The lm_head's rows of the draft vocabulary [S, H] (drafter/draft_vocab.py), or
        # None for logits over the whole vocabulary (vLLM's own compute_logits), and its
        # product: rows [N, H] -> [N, S].
        self.draft_head: torch.Tensor | None = None
        self._draft_product: Callable[[torch.Tensor], torch.Tensor] | None = None

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
        return _whole_vocab(self.model.embed_tokens.weight, vocab)

    def use_draft_vocab(self, vocab_ids: torch.Tensor, vocab: int) -> None:
        """Logits over the draft vocabulary only: the lm_head's rows of vocab_ids [S],
        copied once (a 6x smaller product per step for S = V / 6)."""
        weight = getattr(self.lm_head, "weight", None)
        if weight is None or not weight.is_floating_point():
            raise DominoTreeConfigError(
                "draft_vocab needs the target's lm_head as a plain weight matrix, and this "
                "target's is quantized; set draft_vocab 0 (the whole vocabulary)"
            )
        head = _whole_vocab(weight, vocab)
        self.draft_head = head[vocab_ids.to(head.device)].contiguous()
        self._draft_product = _product_by(self.draft_head)

    def draft_logits(self, rows: torch.Tensor) -> torch.Tensor:
        """The drafter's marginal logits: [N, H] -> [N, V], or [N, S] over the draft
        vocabulary, with the target's logit soft cap and scale as vLLM applies them."""
        if self.draft_head is None:
            return self.compute_logits(rows)
        logits = self._draft_product(rows.to(self.draft_head.dtype))
        processor = self.logits_processor
        if processor.soft_cap is not None:
            logits = torch.tanh(logits / processor.soft_cap) * processor.soft_cap
        if processor.scale != 1.0:
            logits = logits * processor.scale
        return logits


def _product_by(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """x [N, H] -> x @ weight.T [N, S], by the GEMM vLLM's own linear layers use on this
    platform. On CPU that is vLLM's dispatch (oneDNN or SGL's kernel, the weight prepacked
    once): for the shipped SmolLM2 drafter's 8192-token draft vocabulary (576 wide,
    float32) it took 0.17 ms over a budget-4 step's 4 rows where torch's F.linear took 1.2
    ms, 0.29 against 1.66 over 12 (a 2-core AMD EPYC, 2026-12-07). On GPUs F.linear is
    cuBLAS, as vLLM's."""
    if weight.device.type != "cpu":
        return lambda x: torch.nn.functional.linear(x, weight)
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    layer = torch.nn.Module()  # dispatch sets layer.cpu_linear from layer.weight
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    return lambda x: layer.cpu_linear(x, weight, None)


def _whole_vocab(table: torch.Tensor, vocab: int) -> torch.Tensor:
    """A vocab-parallel table's rows over the whole vocabulary, [V, H]: under tensor
    parallelism the shards are gathered (they split the padded vocabulary evenly; the
    real ids come first)."""
    from vllm.distributed import get_tensor_model_parallel_world_size
    from vllm.distributed.communication_op import tensor_model_parallel_all_gather

    if get_tensor_model_parallel_world_size() == 1:
        return table[:vocab]
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
    target's embedding over the whole vocabulary; Domino's node step (trees and chain) as
    config.node_step resolves it (the Triton step on CUDA wherever it applies), on either
    runner. With a draft vocabulary the model's `draft_logits` cover it too."""
    vocab = vllm_config.model_config.get_vocab_size()
    vocab_ids = None
    if options.draft_vocab:
        vocab_ids = draft_vocab_ids(spec.path, options.draft_vocab, vocab).to(device)
        model.use_draft_vocab(vocab_ids, vocab)
    width = options.draft_vocab or spec.vocab_size  # the logits the top M is taken of
    step = node_step(options.scorer, options.candidates, width, cuda=device.type == "cuda")
    head = None
    if spec.is_domino:
        # vLLM may load weights before the model reaches its device.
        head = DominoHead(spec, {k: v.to(device) for k, v in model.domino_tensors.items()})
    return make_scorer(
        options.scorer,
        head,
        model.full_vocab_embedding(vocab),
        shape=shape,
        candidates=options.candidates,
        prefix_len=spec.pure_draft_prefix_len,
        max_requests=max_requests,
        kernels=step == "triton",
        vocab_ids=vocab_ids,
        # CPU: float32 node steps (one-row bfloat16 products are slow there).
        step_dtype=torch.float32 if device.type == "cpu" else None,
        temperature=options.score_temperature,
    )
