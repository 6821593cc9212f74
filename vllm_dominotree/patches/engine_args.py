"""Patch: translate `"method": "dominotree"` before vLLM builds its config.

Why: vLLM 0.32's `SpeculativeConfig.method` is a closed Literal with no registry; an
unknown method fails in `SpeculativeConfig.__post_init__`.
How: `EngineArgs.create_engine_config` (run in process 0 by LLM, AsyncLLM and the API
server) is wrapped; when the speculative config names our method it is rewritten into
vLLM's DFlash plumbing plus `additional_config["dominotree"]`, the worker class is set
to the DominoTree worker, and unsupported engine options are refused with a message;
the engine gets its block of figures for /metrics (metrics.py); unless the user chose
capture sizes, the engine's CUDA graphs also cover decode steps of up to `graph_requests`
requests (graph_sizes.py: vLLM's own stop at 512 tokens, 30 trees).
Removal: when vLLM accepts plugin-registered speculative methods.
"""

from __future__ import annotations

import functools
import logging

import torch
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import current_platform
from vllm.platforms.interface import CpuArchEnum

from ..config import DominoTreeConfig, DominoTreeConfigError, accept_kernel, node_step
from ..drafter.checkpoint import DrafterFormatError, DrafterSpec, check_fits_target, read_spec
from ..graph_sizes import add_decode_graph_sizes, user_chose_sizes
from ..metrics import bind, export_for_engine
from ..openmp import gnu_openmp_warning, intel_openmp, preloaded_runtime
from ..speculative import ADDITIONAL_CONFIG_KEY, is_dominotree, translate
from .input_processor import patch_openai_requests

logger = logging.getLogger(__name__)

CPU_WORKER = "vllm_dominotree.engine.cpu_worker.DominoTreeCPUWorker"
GPU_WORKER = "vllm_dominotree.engine.gpu_worker.DominoTreeGPUWorker"


def prepare_engine_args(args: EngineArgs) -> None:
    """Rewrite `args` in place for a DominoTree engine (raises on bad options)."""
    if not (current_platform.is_cpu() or current_platform.is_cuda()):
        raise DominoTreeConfigError(
            f"speculative method 'dominotree' runs on CPU and CUDA, not on "
            f"{current_platform.device_name}"
        )
    if args.pipeline_parallel_size != 1:
        raise DominoTreeConfigError(
            "speculative method 'dominotree' does not support pipeline parallelism; "
            "set pipeline_parallel_size=1"
        )
    if args.data_parallel_size != 1:
        raise DominoTreeConfigError(
            f"speculative method 'dominotree' does not support data parallelism yet "
            f"(data_parallel_size={args.data_parallel_size}): run one engine per replica "
            "(tensor parallelism within each works), or set data_parallel_size=1"
        )
    if not current_platform.is_cuda() and accept_kernel(cuda=False) == "triton":
        raise DominoTreeConfigError(
            "DOMINOTREE_ACCEPT_KERNEL=triton accepts trees with a CUDA kernel; "
            "unset it (or set it to torch) on CPU"
        )
    vllm_spec, options = translate(args.speculative_config, on_cpu=current_platform.is_cpu())
    args.speculative_config = vllm_spec
    args.additional_config = {**(args.additional_config or {}), ADDITIONAL_CONFIG_KEY: options}
    # Scheduling: vLLM's own choice for DFlash (asynchronous on CUDA, where nothing in a
    # step waits for its trees; synchronous on CPU).
    args.worker_cls = CPU_WORKER if current_platform.is_cpu() else GPU_WORKER
    # vLLM's own CUDA graph modes stay (FULL graphs for uniform decode batches, where the
    # tree fix-up is captured; piecewise for mixed batches). The V1 runner is chosen per
    # engine by patches/model_runner_choice.py.


def check_engine_config(config) -> tuple[DominoTreeConfig, DrafterSpec]:
    """Refuse targets the tree runner cannot verify and drafters that do not fit the
    target, once vLLM knows the model (still in process 0, before any worker starts);
    returns the options and the drafter's spec it read."""
    model = config.model_config
    if model.is_hybrid or model.is_attention_free:
        raise DominoTreeConfigError(
            f"speculative method 'dominotree' needs an attention-only target; {model.model} "
            "has recurrent (Mamba/linear-attention) layers, whose state cannot follow a tree"
        )
    if model.logprobs_mode not in ("raw_logprobs", "raw_logits"):
        raise DominoTreeConfigError(
            f"logprobs_mode={model.logprobs_mode!r}: speculative method 'dominotree' reports "
            "the target's raw logprobs (before temperature and top-k/top-p); set "
            "logprobs_mode to raw_logprobs (the default) or raw_logits"
        )
    spec = read_spec(config.speculative_config.model)
    try:
        check_fits_target(
            spec,
            hidden_size=model.get_hidden_size(),
            vocab_size=model.get_vocab_size(),
            num_layers=model.get_total_num_hidden_layers(),
        )
    except DrafterFormatError as err:
        raise DominoTreeConfigError(f"{err} (target: {model.model})") from err
    options = DominoTreeConfig(**config.additional_config[ADDITIONAL_CONFIG_KEY])
    width = options.draft_vocab or spec.vocab_size  # the logits the scorer takes its top M of
    # Refuses a DOMINOTREE_NODE_STEP this engine cannot run; the workers resolve the same.
    node_step(options.scorer, options.candidates, width, cuda=current_platform.is_cuda())
    # x86 only: the capabilities below are x86's (ARM's bf16 is another matter).
    if current_platform.is_cpu() and current_platform.get_cpu_architecture() == CpuArchEnum.X86:
        native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
        if warning := slow_bfloat16_warning(model.dtype, native_bf16=native):
            logger.warning(warning)
        if warning := gnu_openmp_warning(preloaded_runtime(), intel_openmp()):
            logger.warning(warning)
    return options, spec


def slow_bfloat16_warning(dtype: torch.dtype, native_bf16: bool) -> str | None:
    """What a CPU engine's user should know when its target runs bfloat16 on an x86 CPU
    without native bf16 arithmetic (AVX512-BF16 or AMX), else None. There vLLM's oneDNN
    cannot build its bf16 products and falls back to torch's, whose cost grows with the
    rows: on a 2-core AMD EPYC (AVX2) SmolLM2's lm_head took 3.5 / 14.8 / 51.3 ms for 1 /
    5 / 17 rows, and the shipped pair's harness chats ran at 0.42x of plain decoding in
    bfloat16, 0.70x and 0.87x in float32 (benchmarks/results/cpu_2026-12-06e_amd/)."""
    if dtype != torch.bfloat16 or native_bf16:
        return None
    return (
        "dominotree: this CPU has no native bfloat16 arithmetic (AVX512-BF16 or AMX), so "
        "vLLM runs the target's bfloat16 products through torch's fallback, whose cost "
        "grows with the rows: every verification of budget + 1 rows then costs several "
        "plain steps and speculation slows decoding down; run the target in float32 "
        "(--dtype float32, or LLM(dtype='float32'))"
    )


def patch_engine_args() -> None:
    original = EngineArgs.create_engine_config
    if getattr(original, "_dominotree", False):
        return

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        if not is_dominotree(self.speculative_config):
            return original(self, *args, **kwargs)
        prepare_engine_args(self)
        patch_openai_requests()  # a streamed request is refused before its stream starts
        block = export_for_engine()  # the plugin's figures at /metrics (metrics.py)
        sizes_chosen = user_chose_sizes(self)
        config = original(self, *args, **kwargs)
        options, spec = check_engine_config(config)
        if not sizes_chosen:
            # V2's DFlash speculator takes its graph sizes from the engine's list; V1's
            # drafter captures its own (engine/draft_graphs.py).
            draft_rows = spec.block_size if options.model_runner == "v2" else None
            add_decode_graph_sizes(config, options.graph_requests, draft_rows)
        bind(config, block)
        return config

    create_engine_config._dominotree = True
    EngineArgs.create_engine_config = create_engine_config
