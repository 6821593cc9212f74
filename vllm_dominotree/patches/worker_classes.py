"""Patch (scoped): the classes vLLM's worker and runners construct by name.

Why: `CPUWorker.init_device` builds `CPUModelRunner` (V1) or `cpu.model_runner.
CPUModelRunner` (V2), the V1 runner builds `DFlashProposer` for method "dflash" and the
V2 runner builds its speculator with `init_speculator`, all by module-level name with
no hook. The V1 runner also builds its batch's logits processors with
`build_logitsprocs`, which under any speculative method leaves out min_p and logit_bias
(vLLM's rejection sampler lacks them); the tree runner applies them per tree row
(engine/sampling_constraints.py), so it builds vLLM's built-in set.
How: while the DominoTree CPU worker initialises its device (engine/cpu_worker.py) and
while the tree runner or the V2 runner initialises (engine/runner.py,
engine/v2_runner.py), those module attributes point at the DominoTree classes (passed
in: patches/ imports nothing of engine/); they are restored right after, so nothing
else in the process sees the change.
Removal: when vLLM gives CPUWorker a `_make_model_runner` hook (the CUDA Worker has one)
and the runners a proposer / speculator factory.
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


def cpu_worker_builds_v2(runner_cls):
    """`CPUWorker.init_device` builds `runner_cls` instead of the V2 `CPUModelRunner`."""
    import vllm.v1.worker.cpu.model_runner as cpu_model_runner_v2

    return _swapped(cpu_model_runner_v2, "CPUModelRunner", runner_cls)


def v2_runner_builds_speculator(speculator_cls):
    """The V2 runner's `__init__` builds `speculator_cls(vllm_config, device)` as its
    speculator (it imports `init_speculator` by name)."""
    import vllm.v1.worker.gpu.model_runner as model_runner_v2

    def init_speculator(vllm_config, device, req_states):
        return speculator_cls(vllm_config, device)

    return _swapped(model_runner_v2, "init_speculator", init_speculator)


def runner_builds_proposer(proposer_cls):
    """The V1 runner's `__init__` builds `proposer_cls` for method "dflash"."""
    import vllm.v1.worker.gpu_model_runner as gpu_model_runner

    return _swapped(gpu_model_runner, "DFlashProposer", proposer_cls)


def runner_builds_every_logitsproc():
    """The V1 runner's `__init__` builds vLLM's built-in logits processors (min_p,
    logit_bias, min_tokens) for its batch; custom ones and pooling models get vLLM's own
    answer (a refusal under speculative decoding)."""
    import vllm.v1.worker.gpu_model_runner as gpu_model_runner
    from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS, LogitsProcessors

    original = gpu_model_runner.build_logitsprocs

    def build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model, custom=()):
        if is_pooling_model or custom:
            return original(vllm_config, device, is_pin_memory, is_pooling_model, custom)
        return LogitsProcessors(
            ctor(vllm_config, device, is_pin_memory) for ctor in BUILTIN_LOGITS_PROCESSORS
        )

    return _swapped(gpu_model_runner, "build_logitsprocs", build_logitsprocs)
