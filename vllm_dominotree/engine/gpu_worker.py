"""The DominoTree worker for CUDA: vLLM's Worker building the tree runner on the V1
model runner (`_make_model_runner` is the Worker's own hook)."""

from __future__ import annotations

from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from ..patches.worker_registrations import register_worker_overrides
from .runner import DominoTreeRunnerMixin, DominoTreeWorkerMixin


class DominoTreeGPUModelRunner(DominoTreeRunnerMixin, GPUModelRunner):
    """The tree runner (runner.py) on vLLM's CUDA model runner."""


class DominoTreeGPUWorker(DominoTreeWorkerMixin, Worker):
    def init_device(self) -> None:
        register_worker_overrides()
        super().init_device()

    def _make_model_runner(self) -> DominoTreeGPUModelRunner:
        return DominoTreeGPUModelRunner(self.vllm_config, self.device)
