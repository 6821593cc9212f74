"""Patch: a DominoTree engine runs vLLM's V1 model runner; other engines keep vLLM's choice.

Why: the tree runner extends the V1 runner (`GPUModelRunner`); the V2 runner's
speculators are hard-coded in `init_speculator`. vLLM picks the runner from the
process-wide `VLLM_USE_V2_MODEL_RUNNER` (read through `VllmConfig.use_v2_model_runner`
by the scheduler, the workers and the input processor), and setting that variable in
process 0 would also turn every later engine of the process (a baseline in the same
script) to V1.
How: the `VllmConfig.use_v2_model_runner` property answers False for a config that
carries DominoTree's options in `additional_config` and defers to vLLM for every other
config. The plugin is loaded in every vLLM process, so scheduler, engine core and
workers all see the same answer.
Related upstream: vLLM's plan to retire V1 (the V2 runner is the default since 0.2x).
Removal: when the tree runner moves to the V2 runner, or vLLM gives plugins a runner hook.
"""

from __future__ import annotations

from vllm.config.vllm import VllmConfig

from ..speculative import ADDITIONAL_CONFIG_KEY


def patch_model_runner_choice() -> None:
    original = VllmConfig.use_v2_model_runner
    if getattr(original.fget, "_dominotree", False):
        return

    def use_v2_model_runner(self) -> bool:
        if ADDITIONAL_CONFIG_KEY in (self.additional_config or {}):
            return False
        return original.fget(self)

    use_v2_model_runner._dominotree = True
    VllmConfig.use_v2_model_runner = property(use_v2_model_runner)
