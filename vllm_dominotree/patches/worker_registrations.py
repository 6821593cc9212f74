"""Patch (DominoTree workers only): the drafter model class and the CPU attention backend.

Model registry. Why: vLLM maps `DFlashDraftModel` to `DFlashQwen3ForCausalLM`, which
does not load Domino's `prefix_gru.*` / `embed_proj.*`. How: the official
`ModelRegistry.register_model` points the architecture at `DominoDraftForCausalLM`,
a subclass that also keeps those tensors (plain DFlash checkpoints load as before).
Removal: when vLLM loads Domino checkpoints itself.

Attention backend. Why: CPU_ATTN has no per-request mask, and tree verification needs
ancestor-only attention for tree rows. How: the official `register_backend` override
points CPU_ATTN at `TreeCPUAttentionBackend`, a subclass that is inert unless the
runner publishes a tree context for the target's forward. Removal: when vLLM has tree
attention with per-request masks.
"""

from __future__ import annotations


def register_worker_overrides() -> None:
    from vllm import ModelRegistry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    ModelRegistry.register_model(
        "DFlashDraftModel", "vllm_dominotree.engine.drafter_model:DominoDraftForCausalLM"
    )
    register_backend(
        AttentionBackendEnum.CPU_ATTN,
        "vllm_dominotree.engine.tree_attention.TreeCPUAttentionBackend",
    )
