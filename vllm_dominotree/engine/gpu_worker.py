"""The DominoTree worker for CUDA: vLLM's Worker building the tree runner on the V1
model runner, or vLLM's V2 runner with the plugin's speculator (option model_runner
"v2"); `_make_model_runner` is the Worker's own hook."""

from __future__ import annotations

from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GPUModelRunnerV2
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from ..patches.worker_registrations import register_worker_overrides
from .runner import DominoTreeRunnerMixin, DominoTreeWorkerMixin
from .v2_runner import DominoTreeV2RunnerMixin


class DominoTreeGPUModelRunner(DominoTreeRunnerMixin, GPUModelRunner):
    """The tree runner (runner.py) on vLLM's CUDA model runner."""


class DominoTreeGPUModelRunnerV2(DominoTreeV2RunnerMixin, GPUModelRunnerV2):
    """vLLM's V2 CUDA runner with the plugin's speculator (v2_runner.py)."""


class DominoTreeGPUWorker(DominoTreeWorkerMixin, Worker):
    def init_device(self) -> None:
        register_worker_overrides()
        super().init_device()

    def _make_model_runner(self) -> DominoTreeGPUModelRunner | DominoTreeGPUModelRunnerV2:
        if self.use_v2_model_runner:
            return DominoTreeGPUModelRunnerV2(self.vllm_config, self.device)
        return DominoTreeGPUModelRunner(self.vllm_config, self.device)
