"""Patch: a DominoTree engine runs the model runner its `model_runner` option names
(V1 by default); other engines keep vLLM's choice.

Why: the tree runner extends the V1 runner (`GPUModelRunner`), and the V2 runner port
(engine/v2_runner.py) is opt-in until it has run on a GPU. vLLM picks the runner from the
process-wide `VLLM_USE_V2_MODEL_RUNNER` (read through `VllmConfig.use_v2_model_runner`
by the scheduler, the workers and the input processor), and setting that variable in
process 0 would also turn every later engine of the process (a baseline in the same
script) to the same runner.
How: the `VllmConfig.use_v2_model_runner` property answers from the DominoTree options
in `additional_config` for a config that carries them (`model_runner`: "v1" or "v2") and
defers to vLLM for every other config. The plugin is loaded in every vLLM process, so
scheduler, engine core and workers all see the same answer.
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
        options = (self.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
        if options is not None:
            return options.get("model_runner", "v1") == "v2"
        return original.fget(self)

    use_v2_model_runner._dominotree = True
    VllmConfig.use_v2_model_runner = property(use_v2_model_runner)
