"""Which decode steps a DominoTree engine runs inside CUDA graphs.

vLLM 0.32 captures graphs for steps of up to 512 tokens (1024 on Blackwell) and keeps
that ceiling when a decode step holds several rows a request: past it, "uniform decode
batches fall back to eager execution unless users explicitly configure wider capture
sizes" (`VllmConfig._set_cudagraph_sizes`). A tree verifies budget + 1 = 17 rows a
request, so vLLM's graphs stop at 30 requests, and a step of 64 requests (1,088 rows)
ran eagerly, bound by the host: 46.6 ms a round on an H100 where its GPU time was 23.1
(benchmarks/results/h100_2026-12-07e).

So a DominoTree engine also captures the decode steps of up to `graph_requests`
requests (options) at the target's verification (1 + num_speculative_tokens rows a
request) and, on the V2 runner, whose DFlash speculator takes its graph sizes from the
same list, at the drafter's query block (its block size; V1's drafter captures every
batch size itself, engine/draft_graphs.py), with vLLM's own grid of request counts (1,
2, 4, 8 to 248 by 8, then by 16).
An engine whose user chose its capture sizes, or that runs without graphs (CPU,
enforce_eager), keeps vLLM's sizes.
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger

# Under vLLM's logger, whose handler and level print the engine's start: a user sees the
# sizes added beside vLLM's own capture messages.
logger = init_logger(f"vllm.{__name__}")

# The engine arguments through which a user chooses capture sizes (EngineArgs fields,
# and the same two inside its compilation_config).
USER_SIZE_FIELDS = ("cudagraph_capture_sizes", "max_cudagraph_capture_size")


def request_grid(max_requests: int) -> list[int]:
    """vLLM's request counts for decode graphs (its `request_counts`), up to
    max_requests: 1, 2, 4, then every 8th to 248, every 16th from 256, and max_requests."""
    counts = [n for n in (1, 2, 4) if n <= max_requests]
    counts += range(8, min(max_requests + 1, 256), 8)
    counts += range(256, max_requests + 1, 16)
    return sorted({*counts, max_requests}) if max_requests >= 1 else []


def decode_sizes(query_lens: tuple[int, ...], max_requests: int, max_tokens: int) -> list[int]:
    """The token counts of decode steps of up to max_requests requests at each query
    length, within max_tokens (the scheduler's tokens per step)."""
    return sorted(
        {n * q for q in query_lens for n in request_grid(max_requests) if n * q <= max_tokens}
    )


def user_chose_sizes(args: Any) -> bool:
    """Whether the engine arguments name capture sizes (then they are kept as given)."""
    compilation = getattr(args, "compilation_config", None)
    if isinstance(compilation, dict):
        chosen = [compilation.get(name) for name in USER_SIZE_FIELDS]
    else:
        chosen = [getattr(compilation, name, None) for name in USER_SIZE_FIELDS]
    chosen += [getattr(args, name, None) for name in USER_SIZE_FIELDS]
    return any(value is not None for value in chosen)


def add_decode_graph_sizes(config: Any, graph_requests: int, draft_rows: int | None) -> list[int]:
    """Add to the engine's capture sizes the decode steps of up to graph_requests
    requests (and max_num_seqs), of the verification and, given draft_rows, of the
    drafter's block; returns the sizes added. No graphs (an empty list): nothing to add."""
    compilation = config.compilation_config
    captured = list(compilation.cudagraph_capture_sizes or [])
    if not captured or graph_requests == 0:
        return []
    scheduler = config.scheduler_config
    requests = min(graph_requests, scheduler.max_num_seqs)
    verify_rows = 1 + config.speculative_config.num_speculative_tokens
    wanted = decode_sizes(
        (verify_rows,) if draft_rows is None else (verify_rows, draft_rows),
        requests,
        scheduler.max_num_batched_tokens,
    )
    added = sorted(set(wanted) - set(captured))
    if added:
        sizes = sorted({*captured, *added})
        compilation.cudagraph_capture_sizes = sizes
        compilation.max_cudagraph_capture_size = sizes[-1]
        logger.info(
            "dominotree: CUDA graphs for decode steps of up to %d requests: capture sizes "
            "%s added to vLLM's, which stop at %d tokens; the option graph_requests 0 "
            "keeps vLLM's",
            requests,
            added,
            captured[-1],
        )
    return added
