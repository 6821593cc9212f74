"""Single-stream reference decoder on a Hugging Face transformers target.

Like the papers' harnesses: autoregressive, chain, marginal tree (DDTree) and
conditional tree (DominoTree), with per-round stage timings. It is the oracle the vLLM
integration is checked against, so it stays plain: one sequence, a DynamicCache,
the tree verified in one target forward with a 4D ancestor-only mask.

Round (speculative modes), with the target's KV cache holding every committed token
but the anchor (the last verified token):
  draft   the drafter's block pass from its context cache -> hidden rows, marginals
  build   the best-first tree (root = anchor)
  verify  one target forward over the tree's nodes at positions start + depth
  commit  sample-and-match, move the accepted rows' KV to the first slots, feed their
          hidden states to the drafter's context
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from .config import DominoTreeConfig
from .drafter.checkpoint import check_fits_target
from .drafter.draft_vocab import draft_vocab_ids
from .drafter.model import Drafter
from .stage_clock import StageClock
from .tree.acceptance import SamplingParams, accept, draw_target_tokens, sibling_accepts
from .tree.ancestry import ancestor_mask
from .tree.builder import build_trees
from .tree.scorers import make_scorer

STAGES = ("draft", "build", "verify", "commit")


@dataclass
class DecodeResult:
    mode: str
    tokens: list[int]  # generated tokens (prompt excluded)
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per round
    stage_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    sibling_accepts: int = 0  # accepted nodes that were not their parent's first child

    @property
    def rounds(self) -> int:
        return len(self.accept_lengths)

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / max(1, self.rounds)


class ReferenceDecoder:
    """mode: "ar" (no drafter) or a DominoTreeConfig scorer for the drafter."""

    def __init__(
        self,
        target: PreTrainedModel,
        drafter: Drafter | None = None,
        config: DominoTreeConfig | None = None,
    ):
        self.target = target
        self.device = next(target.parameters()).device
        self.embed = target.get_input_embeddings().weight
        self.lm_head = target.get_output_embeddings()
        self.drafter = drafter
        self.config = config
        if (drafter is None) != (config is None):
            raise ValueError("give both a drafter and a DominoTreeConfig, or neither (AR)")
        if drafter is not None:
            cfg = target.config.get_text_config()
            check_fits_target(
                drafter.spec,
                hidden_size=cfg.hidden_size,
                vocab_size=cfg.vocab_size,
                num_layers=cfg.num_hidden_layers,
            )
            config.check_drafter(drafter.spec)
            self.shape = config.tree_shape(drafter.spec.num_drafts)
            # The draft vocabulary: the lm_head's rows of its tokens [S, H] (None: all).
            vocab_ids, self.draft_head = None, None
            if config.draft_vocab:
                vocab_ids = draft_vocab_ids(
                    drafter.spec.path, config.draft_vocab, cfg.vocab_size
                ).to(self.device)
                self.draft_head = self.lm_head.weight[vocab_ids]
            self.scorer = make_scorer(
                config.scorer,
                drafter.head,
                self.embed,
                shape=self.shape,
                candidates=config.candidates,
                prefix_len=drafter.spec.pure_draft_prefix_len,
                max_requests=1,
                vocab_ids=vocab_ids,
                temperature=config.score_temperature,
            )

    @property
    def mode(self) -> str:
        return "ar" if self.config is None else self.config.scorer

    @torch.inference_mode()
    def generate(
        self,
        prompt: list[int],
        max_new_tokens: int,
        sampling: SamplingParams | None = None,
        stop_token_ids: tuple[int, ...] = (),
    ) -> DecodeResult:
        sampling = sampling or SamplingParams()
        result = DecodeResult(self.mode, [])
        generator = sampling.make_generator(self.device)
        clock = StageClock(self.device)
        clock.reset(enabled=True)
        cache = DynamicCache(config=self.target.config)
        with clock.stage("prefill"):
            ids = torch.tensor([prompt], device=self.device)
            out = self.target(
                ids, past_key_values=cache, output_hidden_states=self.drafter is not None
            )
            first = int(draw_target_tokens(out.logits[0, -1:], sampling, generator)[0])
            result.tokens.append(first)
            if self.drafter is not None:
                context = self.drafter.backbone.context_kv(
                    self._features(out.hidden_states, slice(None)),
                    torch.arange(len(prompt), device=self.device),
                )

        def done() -> bool:
            return len(result.tokens) >= max_new_tokens or result.tokens[-1] in stop_token_ids

        with clock.stage("decode"):
            while not done():
                if self.drafter is None:
                    token = torch.tensor([[result.tokens[-1]]], device=self.device)
                    out = self.target(token, past_key_values=cache)
                    result.tokens.append(
                        int(draw_target_tokens(out.logits[0], sampling, generator)[0])
                    )
                    result.accept_lengths.append(1)
                    continue
                self._round(result, cache, context, sampling, generator, clock)
        result.prefill_seconds = clock.seconds["prefill"]
        result.decode_seconds = clock.seconds["decode"]
        result.stage_seconds = {s: clock.seconds[s] for s in STAGES}
        result.tokens = self._truncate(result.tokens, max_new_tokens, stop_token_ids)
        return result

    def _round(self, result, cache, context, sampling, generator, clock):
        """One draft/build/verify/commit round: appends the committed tokens to
        result.tokens, and the committed rows to both caches."""
        spec = self.drafter.spec
        anchor = result.tokens[-1]
        start = cache.get_seq_length()  # the anchor's position
        with clock.stage("draft"):
            hidden = self.drafter.block_hidden(
                self.embed[anchor], self.embed[spec.mask_token_id], start, context
            )[: self.shape.max_depth]  # the depths a tree of the budget can reach
            if self.draft_head is None:
                base_logits = self.lm_head(hidden)  # [K, V]
            else:
                base_logits = hidden @ self.draft_head.T  # [K, S]
        with clock.stage("build"):
            self.scorer.prepare(hidden[None], base_logits[None])
            tree = build_trees(self.scorer, [anchor], self.shape)[0]

        with clock.stage("verify"):
            tokens = torch.tensor([tree.tokens], device=self.device)
            positions = start + torch.tensor([tree.depths], device=self.device)
            visible = torch.ones(tree.num_nodes, start + tree.num_nodes, dtype=torch.bool)
            visible[:, start:] = ancestor_mask(tree.parents)
            mask = torch.zeros(visible.shape, dtype=self.embed.dtype).masked_fill(
                ~visible, torch.finfo(self.embed.dtype).min
            )
            out = self.target(
                tokens,
                position_ids=positions,
                attention_mask=mask[None, None].to(self.device),
                past_key_values=cache,
                output_hidden_states=True,
            )

        with clock.stage("commit"):
            target_tokens = draw_target_tokens(out.logits[0], sampling, generator).tolist()
            path, bonus = accept(tree, target_tokens)
            keep = torch.tensor([0, *path], device=self.device)
            for layer in cache.layers:
                layer.keys = torch.cat(
                    [layer.keys[:, :, :start], layer.keys[:, :, start + keep]], 2
                )
                layer.values = torch.cat(
                    [layer.values[:, :, :start], layer.values[:, :, start + keep]], 2
                )
            result.tokens.extend([tree.tokens[n] for n in path] + [bonus])
            result.accept_lengths.append(len(path) + 1)
            result.sibling_accepts += sibling_accepts(tree, path)
            context.append(
                self.drafter.backbone.context_kv(
                    self._features(out.hidden_states, keep),
                    torch.arange(start, start + len(keep), device=self.device),
                )
            )

    def _features(self, hidden_states: tuple[torch.Tensor, ...], rows) -> torch.Tensor:
        """The drafter's context input: the target's hidden states after each of
        target_layer_ids, concatenated. -> [rows, n_ids * H]"""
        ids = self.drafter.spec.target_layer_ids
        return torch.cat([hidden_states[i + 1][0, rows] for i in ids], dim=-1)

    @staticmethod
    def _truncate(tokens: list[int], max_new_tokens: int, stop_ids: tuple[int, ...]) -> list[int]:
        tokens = tokens[:max_new_tokens]
        for i, t in enumerate(tokens):
            if t in stop_ids:
                return tokens[: i + 1]
        return tokens
