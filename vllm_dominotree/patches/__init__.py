"""Every place where vllm-dominotree changes vLLM 0.32's own objects.

Each module here documents why the patch exists, how it works and when it can go.

- engine_args (process 0: LLM / API server): `"method": "dominotree"` -> DFlash + options
- input_processor (process 0): refuses per-request features the tree sampler lacks
- worker_classes (DominoTree workers): the runner class the CPU worker builds and the
  proposer class the runner builds
- worker_registrations (DominoTree workers): `DFlashDraftModel` also loads Domino's
  weights; CPU_ATTN gains tree verification

`apply_frontend_patches()` is called from the plugin entry point in every process (it
is cheap and idempotent); the worker-side patches are applied by the DominoTree worker
classes, so engines that do not use the method are left as vLLM made them.
"""

from .engine_args import patch_engine_args
from .input_processor import patch_input_processor


def apply_frontend_patches() -> None:
    patch_engine_args()
    patch_input_processor()
