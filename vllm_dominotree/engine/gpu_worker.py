"""The DominoTree worker for CUDA: vLLM's Worker building the tree runner on the V1
model runner (`_make_model_runner` is the Worker's own hook)."""

from __future__ import annotations

import vllm.v1.worker.gpu_model_runner as runner_module
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from ..patches.worker_classes import swapped
from ..patches.worker_registrations import register_worker_overrides
from .proposer import DominoTreeProposer
from .runner import DominoTreeRunnerMixin, DominoTreeWorkerMixin


class DominoTreeGPUModelRunner(DominoTreeRunnerMixin, GPUModelRunner):
    def __init__(self, vllm_config, device):
        with swapped(runner_module, "DFlashProposer", DominoTreeProposer):
            super().__init__(vllm_config, device)


class DominoTreeGPUWorker(DominoTreeWorkerMixin, Worker):
    def init_device(self) -> None:
        register_worker_overrides()
        super().init_device()

    def _make_model_runner(self) -> DominoTreeGPUModelRunner:
        return DominoTreeGPUModelRunner(self.vllm_config, self.device)
