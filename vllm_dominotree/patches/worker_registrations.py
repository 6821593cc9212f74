"""Patch (DominoTree workers only): the drafter model class and the CPU attention backend.

Model registry. Why: vLLM maps `DFlashDraftModel` to `DFlashQwen3ForCausalLM`, which
does not load Domino's `prefix_gru.*` / `embed_proj.*`. How: the official
`ModelRegistry.register_model` points the architecture at `DominoDraftForCausalLM`,
a subclass that also keeps those tensors (plain DFlash checkpoints load as before).
Removal: when vLLM loads Domino checkpoints itself.

Attention backends. Why: no vLLM backend takes a per-request mask, and tree
verification needs ancestor-only attention for tree rows. How: the official
`register_backend` override points CPU_ATTN (CPU) or FLASH_ATTN and TRITON_ATTN (CUDA)
at subclasses that are inert unless the runner publishes a tree context for the
target's forward. Removal: when vLLM has tree attention with per-request masks.
"""

from __future__ import annotations


def register_worker_overrides() -> None:
    from vllm import ModelRegistry
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    ModelRegistry.register_model(
        "DFlashDraftModel", "vllm_dominotree.engine.drafter_model:DominoDraftForCausalLM"
    )
    engine = "vllm_dominotree.engine"
    if current_platform.is_cpu():
        register_backend(
            AttentionBackendEnum.CPU_ATTN, f"{engine}.cpu_attention.TreeCPUAttentionBackend"
        )
    else:
        register_backend(
            AttentionBackendEnum.FLASH_ATTN, f"{engine}.cuda_attention.TreeFlashAttentionBackend"
        )
        register_backend(
            AttentionBackendEnum.TRITON_ATTN, f"{engine}.cuda_attention.TreeTritonAttentionBackend"
        )
