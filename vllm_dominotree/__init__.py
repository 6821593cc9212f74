"""vllm-dominotree: DominoTree speculative decoding as a vLLM plugin.

`register()` is the `vllm.general_plugins` entry point. vLLM calls it once in every
process (the API server / LLM process, the engine core, each worker). It must stay
cheap and import nothing heavy at module level: the engine integration hooks in here.
"""

import logging

__version__ = "0.1.0"

logger = logging.getLogger(__name__)


def register() -> None:
    """vLLM plugin entry point: lets vLLM accept `"method": "dominotree"` (see
    patches/). The engine side is selected through the worker class."""
    from .patches import apply_frontend_patches

    apply_frontend_patches()
    logger.debug("vllm-dominotree %s plugin loaded", __version__)
