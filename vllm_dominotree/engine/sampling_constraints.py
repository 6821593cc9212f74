"""What shapes a request's target distribution beyond temperature, top-k and top-p, for
every logits row of a step: a tree row stands for its request's output so far plus the
drafted tokens on the row's own path (its depth below the root, its path's tokens).

In vLLM's own order (its Sampler): allowed tokens, min_tokens, logit_bias, then the
presence / frequency / repetition penalties (`constrained`); after the temperature
min_p (`min_p_rows`, which acceptance.draw_targets applies), then top-k and top-p;
`draw_constrained` is the whole draw. The
values come from vLLM's batch state as its own sampler reads them: the sampling
metadata's allowed-token mask and penalties, and the built-in logits processors' per
batch row state (min_tokens, logit_bias, min_p), so that a request's law is the one
vLLM gives it without speculation. Nothing here runs unless some request of the step
asks for it.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.utils import apply_penalties
from vllm.utils.torch_utils import make_tensor_with_pad
from vllm.v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)

from .acceptance import draw_targets
from .tree_step import TreeStep


def _builtin(sampling_metadata, kind):
    return next((p for p in sampling_metadata.logitsprocs.all if isinstance(p, kind)), None)


def _min_tokens(sampling_metadata) -> dict:
    """vLLM's min_tokens state: batch row -> (min_tokens, its output so far, its stop
    tokens, structured), for the requests still short of their min_tokens."""
    processor = _builtin(sampling_metadata, MinTokensLogitsProcessor)
    return processor.min_toks if processor is not None else {}


def _logit_bias(sampling_metadata) -> dict:
    """vLLM's logit_bias state: batch row -> {token: bias}."""
    processor = _builtin(sampling_metadata, LogitBiasLogitsProcessor)
    return processor.biases if processor is not None else {}


def _on_rows(per_request: dict, row_ranges: list[tuple[int, int]], device) -> tuple:
    """{batch row: {token: value}} -> (logits rows, tokens, values) tensors: each
    request's entries on every one of its logits rows."""
    rows, tokens, values = [], [], []
    for request, entries in per_request.items():
        first, end = row_ranges[request]
        for row in range(first, end):
            rows += [row] * len(entries)
            tokens += list(entries)
            values += list(entries.values())
    return (
        torch.tensor(rows, device=device),
        torch.tensor(tokens, device=device),
        torch.tensor(values, device=device),
    )


def reshapes_greedy(sampling_metadata) -> bool:
    """Does some request's law move its argmax (so that a greedy step cannot take the
    accept graphs, which hold the plain argmax)?"""
    return (
        not sampling_metadata.no_penalties
        or sampling_metadata.allowed_token_ids_mask is not None
        or bool(_min_tokens(sampling_metadata))
        or bool(_logit_bias(sampling_metadata))
    )


def path_tokens(step: TreeStep, pad: int) -> torch.Tensor:
    """[L, W - 1] long: the drafted tokens on each logits row's path (its own and its
    ancestors' below the root, whose token is the request's last output), `pad` after."""
    tokens = torch.full((step.num_logits, max(step.width - 1, 0)), pad, device=step.token.device)
    row = torch.arange(step.num_logits, device=step.token.device)
    for depth in range(tokens.shape[1]):
        drafted = step.parent_row[row] >= 0  # a drafted node (a root has no parent)
        tokens[:, depth] = torch.where(drafted, step.token[row], pad)
        row = torch.where(drafted, step.parent_row[row], row)
    return tokens


def constrained(
    logits: torch.Tensor,  # [L, V] raw
    row_ranges: list[tuple[int, int]],  # per batch row (request), its logits rows
    row_requests: torch.Tensor,  # [L] long: the request of each row
    row_depths: torch.Tensor,  # [L] long: drafted tokens on each row's path
    row_paths,  # () -> [L, D] long: those tokens (called for penalties only)
    sampling_metadata,
) -> torch.Tensor:
    """The logits every row draws its target from, before temperature: `logits` itself
    when no request constrains them, else a float32 copy with the requests' constraints."""
    if not reshapes_greedy(sampling_metadata):
        return logits
    out = logits.float().clone()
    if sampling_metadata.allowed_token_ids_mask is not None:
        out.masked_fill_(sampling_metadata.allowed_token_ids_mask[row_requests], float("-inf"))
    if min_tokens := _min_tokens(sampling_metadata):
        # Stop tokens are barred from a row while its output (the request's so far and
        # its path's drafts) is shorter than min_tokens.
        per_request = {
            request: {stop: least - len(outputs) for stop in stops}
            for request, (least, outputs, stops, _) in min_tokens.items()
        }
        rows, tokens, short_of = _on_rows(per_request, row_ranges, out.device)
        barred = row_depths[rows] < short_of
        out[rows, tokens] = torch.where(barred, float("-inf"), out[rows, tokens])
    if logit_bias := _logit_bias(sampling_metadata):
        rows, tokens, biases = _on_rows(logit_bias, row_ranges, out.device)
        out[rows, tokens] += biases.to(out.dtype)
    if not sampling_metadata.no_penalties:
        out = penalized(out, row_requests, row_paths(), sampling_metadata)
    return out


def penalized(
    logits: torch.Tensor,  # [L, V] float32, penalized in place
    row_requests: torch.Tensor,  # [L] long
    row_paths: torch.Tensor | None,  # [L, D] long: tokens each row adds to its request's output
    sampling_metadata,
) -> torch.Tensor:
    """The rows with the requests' presence, frequency and repetition penalties (vLLM's
    formulas, apply_penalties), a row's output so far being its request's output tokens
    and the drafted tokens on its path."""
    vocab = logits.shape[1]
    outputs = make_tensor_with_pad(
        sampling_metadata.output_token_ids, pad=vocab, device="cpu", dtype=torch.int64
    ).to(logits.device)
    outputs.masked_fill_(outputs == -1, vocab)  # async scheduling's placeholders
    outputs = outputs[row_requests]
    if row_paths is not None:
        outputs = torch.cat([outputs, row_paths], dim=1)
    return apply_penalties(
        logits,
        sampling_metadata.prompt_token_ids[row_requests],
        outputs,
        sampling_metadata.presence_penalties[row_requests],
        sampling_metadata.frequency_penalties[row_requests],
        sampling_metadata.repetition_penalties[row_requests],
    )


def min_p_rows(sampling_metadata, row_requests: torch.Tensor) -> torch.Tensor | None:
    """[L] float32: each row's request's min_p, None when no request sets one."""
    processor = _builtin(sampling_metadata, MinPLogitsProcessor)
    if processor is None or not processor.min_p_count:
        return None
    return processor.min_p.view(-1)[row_requests]


def draw_constrained(
    logits: torch.Tensor,  # [L, V] raw (left as they are)
    row_ranges: list[tuple[int, int]],  # per batch row (request), its logits rows
    row_requests: torch.Tensor,  # [L] long
    row_depths: torch.Tensor,  # [L] long: drafted tokens on each row's path
    row_paths,  # () -> [L, D] long: those tokens (called for penalties only)
    row_positions: torch.Tensor,  # [L] long: the position of the token each row draws
    sampling_metadata,
) -> torch.Tensor:
    """The target's token at every logits row, [L] long, under its request's law as vLLM
    shapes it (acceptance.draw_targets on the constrained logits, with min_p)."""
    return draw_targets(
        constrained(logits, row_ranges, row_requests, row_depths, row_paths, sampling_metadata),
        row_requests,
        row_ranges,
        row_positions,
        sampling_metadata,
        min_p_rows(sampling_metadata, row_requests),
    )
