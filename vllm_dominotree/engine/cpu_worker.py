"""The DominoTree worker: vLLM's worker with the tree runner (selected by
`parallel_config.worker_cls`, which the engine-args patch sets)."""

from __future__ import annotations

from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from ..patches.worker_classes import cpu_worker_builds
from ..patches.worker_registrations import register_worker_overrides
from .runner import DominoTreeRunnerMixin, DominoTreeWorkerMixin


class DominoTreeCPUModelRunner(DominoTreeRunnerMixin, CPUModelRunner):
    """The tree runner (runner.py) on vLLM's CPU model runner."""


class DominoTreeCPUWorker(DominoTreeWorkerMixin, CPUWorker):
    def init_device(self) -> None:
        register_worker_overrides()
        with cpu_worker_builds(DominoTreeCPUModelRunner):
            super().init_device()
