"""The DominoTree worker: vLLM's worker with the tree runner (selected by
`parallel_config.worker_cls`, which the engine-args patch sets), or with the V2 runner
and the plugin's speculator (option model_runner "v2")."""

from __future__ import annotations

from vllm.v1.worker.cpu.model_runner import CPUModelRunner as CPUModelRunnerV2
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from ..patches.worker_classes import cpu_worker_builds, cpu_worker_builds_v2
from ..patches.worker_registrations import register_worker_overrides
from .runner import DominoTreeRunnerMixin, DominoTreeWorkerMixin
from .v2_runner import DominoTreeV2RunnerMixin


class DominoTreeCPUModelRunner(DominoTreeRunnerMixin, CPUModelRunner):
    """The tree runner (runner.py) on vLLM's CPU model runner."""


class DominoTreeCPUModelRunnerV2(DominoTreeV2RunnerMixin, CPUModelRunnerV2):
    """vLLM's V2 CPU runner with the plugin's speculator (v2_runner.py)."""


class DominoTreeCPUWorker(DominoTreeWorkerMixin, CPUWorker):
    def init_device(self) -> None:
        register_worker_overrides()
        with (
            cpu_worker_builds(DominoTreeCPUModelRunner),
            cpu_worker_builds_v2(DominoTreeCPUModelRunnerV2),
        ):
            super().init_device()
