"""vllm-dominotree: DominoTree speculative decoding as a vLLM plugin.

`register()` is the `vllm.general_plugins` entry point. vLLM calls it once in every
process (the API server / LLM process, the engine core, each worker). It must stay
cheap and import nothing heavy at module level: the engine integration hooks in here.
"""

import logging

__version__ = "0.1.0"

logger = logging.getLogger(__name__)


def register() -> None:
    """vLLM plugin entry point. The engine integration (method name, runner, tree
    attention) is added by the vLLM integration; until then loading is a no-op that
    proves the entry point resolves."""
    logger.debug("vllm-dominotree %s plugin loaded", __version__)
