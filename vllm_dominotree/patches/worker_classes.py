"""Patch (scoped): the classes vLLM's worker and runner construct by name.

Why: `CPUWorker.init_device` builds `CPUModelRunner` and the V1 runner builds
`DFlashProposer` for method "dflash", both by module-level name with no hook.
How: while the DominoTree CPU worker initialises its device (engine/cpu_worker.py) and
while the tree runner initialises (engine/runner.py), those module attributes point at
the DominoTree classes (passed in: patches/ imports nothing of engine/); they are
restored right after, so nothing else in the process sees the change.
Removal: when vLLM gives CPUWorker a `_make_model_runner` hook (the CUDA Worker has one)
and the runner a proposer factory.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def _swapped(module, name: str, replacement):
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        yield
    finally:
        setattr(module, name, original)


def cpu_worker_builds(runner_cls):
    """`CPUWorker.init_device` builds `runner_cls` instead of `CPUModelRunner`."""
    import vllm.v1.worker.cpu_worker as cpu_worker

    return _swapped(cpu_worker, "CPUModelRunner", runner_cls)


def runner_builds_proposer(proposer_cls):
    """The V1 runner's `__init__` builds `proposer_cls` for method "dflash"."""
    import vllm.v1.worker.gpu_model_runner as gpu_model_runner

    return _swapped(gpu_model_runner, "DFlashProposer", proposer_cls)
