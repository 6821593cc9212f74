"""The DominoTree engine on vLLM's Model Runner V2 (option `model_runner: "v2"`).

vLLM's V2 runner keeps every request's state on the device and prepares a step with a
few Triton kernels, where the V1 runner that the tree runner (runner.py) extends
rebuilds a host-side batch each step: on the H200 that host work paced the plugin's
batch-1 round (docs/v2-runner-port.md). This mixin gives the V2 runner the plugin's
speculator (v2_speculator.py); verification, acceptance and the KV cache stay vLLM's
own, which is exact for a chain. Tree verification on V2 (the path's positions, the
tree attention, the tree rejection sampler, the accepted path's K/V moved) is the rest
of the port.
"""

from __future__ import annotations

from ..patches.worker_classes import v2_runner_builds_speculator
from .v2_speculator import DominoChainSpeculator


class DominoTreeV2RunnerMixin:
    """Mixed into vLLM's V2 GPUModelRunner / CPUModelRunner (gpu_worker.py, cpu_worker.py)."""

    def __init__(self, vllm_config, device):
        with v2_runner_builds_speculator(DominoChainSpeculator):
            super().__init__(vllm_config, device)
        assert isinstance(self.speculator, DominoChainSpeculator), "see patches/worker_classes.py"

    def read_stats(self):
        raise NotImplementedError(
            "dominotree: the V2 runner keeps no tree statistics yet (model_runner 'v2' runs "
            "the chain only); vLLM's own spec-decode metrics count its drafts and accepts"
        )
