"""`"method": "dominotree"` -> vLLM's DFlash plumbing plus the plugin's options.

vLLM 0.32 accepts only its own method names. The user's speculative config is
translated before vLLM builds its config (in process 0): vLLM sees a DFlash drafter
with `num_speculative_tokens` = the tree's node budget (so the scheduler reserves one
verification row per node and the drafter's query slots; a budget below the drafter's
block still reserves the block's slots, and the proposer then schedules `budget`
drafts per request, on CPU only), the DominoTree options travel
in `additional_config["dominotree"]`, and the workers use the plugin's worker class.
Everything is validated here, so mistakes fail at startup with a message naming the
key, not inside a worker.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

from .config import (
    CPU_BUDGET,
    CPU_DRAFT_VOCAB,
    DominoTreeConfig,
    DominoTreeConfigError,
    cpu_step_nodes,
)
from .drafter.checkpoint import DrafterFormatError, read_spec
from .drafter.draft_vocab import default_size, draft_vocab_ids
from .drafter.score_temperature import default_temperature

METHOD = "dominotree"
ADDITIONAL_CONFIG_KEY = "dominotree"
# Keys of the user's JSON that are vLLM's, not DominoTree options.
VLLM_KEYS = {"method", "model", "num_speculative_tokens"}


def translate(
    speculative_config: dict[str, Any], on_cpu: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The user's `{"method": "dominotree", "model": ..., <options>}` ->
    (vLLM speculative config, DominoTree options for additional_config)."""
    options = {k.replace("-", "_"): v for k, v in speculative_config.items()}
    drafter = options.get("model")
    if isinstance(drafter, os.PathLike):
        drafter = os.fspath(drafter)
    if not isinstance(drafter, str) or not drafter:
        raise DominoTreeConfigError(
            'speculative config: "method": "dominotree" needs "model": the path of a Domino '
            "or DFlash drafter checkpoint"
        )
    chosen = {k: v for k, v in options.items() if k not in VLLM_KEYS}
    try:
        spec = read_spec(drafter)
        if "score_temperature" not in chosen:  # the drafter's fitted one, else 1
            scorer = chosen.get("scorer", DominoTreeConfig.scorer)
            chosen["score_temperature"] = default_temperature(drafter, scorer)
    except DrafterFormatError as err:
        raise DominoTreeConfigError(f"speculative config 'model': {err}") from err
    try:
        if on_cpu:
            chosen.setdefault("budget", CPU_BUDGET)
            if chosen.get("model_runner", DominoTreeConfig.model_runner) == "v1":
                chosen.setdefault("step_nodes", cpu_step_nodes(chosen["budget"]))
            if "draft_vocab" not in chosen:
                chosen["draft_vocab"] = default_size(drafter, CPU_DRAFT_VOCAB, spec.vocab_size)
        elif chosen.get("scorer") == "chain":
            # vLLM's DFlash verifies the block's rows (its anchor and block - 1 drafts); a
            # Domino chain of the block's every draft verifies one row more, which cost
            # the target's GEMMs and FA3 0.14 ms at batch 1 (4.18 against 4.04, H100,
            # benchmarks/results/h100_2026-12-06f/); with DFlash's rows, 3.98 against 3.98
            # (h100_2026-12-06h/). The cap: an accepted path of block - 1 drafts.
            chosen.setdefault("budget", spec.block_size - 1)
        config = DominoTreeConfig.from_dict(chosen)
        if config.draft_vocab:
            draft_vocab_ids(drafter, config.draft_vocab, spec.vocab_size)
    except DrafterFormatError as err:
        raise DominoTreeConfigError(f"speculative config 'draft_vocab': {err}") from err
    config.check_drafter(spec)
    if config.model_runner == "v2" and on_cpu:
        from vllm.triton_utils import HAS_TRITON

        if not HAS_TRITON:
            raise DominoTreeConfigError(
                "model_runner 'v2' on CPU needs a Triton with a CPU backend (triton-cpu): "
                "vLLM's V2 runner prepares each step with Triton kernels, and this "
                "environment's Triton has no CPU backend; use model_runner 'v1' (the default)"
            )
    if config.step_nodes and (not on_cpu or config.model_runner == "v2"):
        raise DominoTreeConfigError(
            f"step_nodes {config.step_nodes} applies to the CPU engine's tree runner "
            "(model_runner 'v1') only: a step's trees verify fewer rows because fewer "
            "drafts are proposed, which vLLM schedules as proposed only under the CPU's "
            "synchronous scheduling; on CUDA and on the V2 runner every request verifies "
            "its whole budget. Set step_nodes 0 there (or a smaller budget)"
        )
    shape = config.tree_shape(spec.num_drafts)
    # The drafter's query block (anchor + masks, block_size slots) is written into the
    # slots vLLM reserves for drafting: num_speculative_tokens + 1 of them.
    reserved = max(shape.budget, spec.block_size - 1)
    if reserved > shape.budget and not on_cpu:
        raise DominoTreeConfigError(
            f"budget {shape.budget} is below the drafter's block size {spec.block_size} "
            "minus one, which only the CPU engine supports: on CUDA vLLM's decode graphs "
            "replay 1 + num_speculative_tokens rows per request and the drafter's block "
            f"needs that many reserved slots; use budget >= {spec.block_size - 1}"
        )
    if reserved > shape.budget and config.model_runner == "v2":
        # V2 verifies every reserved slot (the tree runner, V1, verifies 1 + budget rows),
        # so the slots past the budget would be verified with stale drafts in them.
        raise DominoTreeConfigError(
            f"budget {shape.budget} is below the drafter's block size {spec.block_size} "
            "minus one, which only model_runner 'v1' supports: vLLM's V2 runner verifies "
            "every slot reserved for the drafter's block; use budget >= "
            f"{spec.block_size - 1} or model_runner 'v1'"
        )
    requested = options.get("num_speculative_tokens")
    if requested is not None and requested != shape.budget:
        raise DominoTreeConfigError(
            f"num_speculative_tokens {requested} contradicts the tree's node budget "
            f"{shape.budget}; leave num_speculative_tokens out (it is the budget) or set "
            "'budget' instead"
        )
    vllm_config = {"method": "dflash", "model": drafter, "num_speculative_tokens": reserved}
    return vllm_config, asdict(config)


def is_dominotree(speculative_config: Any) -> bool:
    return isinstance(speculative_config, dict) and speculative_config.get("method") == METHOD
