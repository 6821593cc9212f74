"""Triton kernels of vllm-dominotree (installed as `vllm_dominotree.kernels`)."""
