"""DFlash / Domino drafters: the released checkpoint format and the model (torch only)."""

from .checkpoint import (
    DrafterFormatError,
    DrafterSpec,
    check_fits_target,
    default_target_layer_ids,
    load_tensors,
    read_spec,
    write_checkpoint,
)
from .model import ContextKV, DFlashBackbone, DominoHead, Drafter

__all__ = [
    "ContextKV",
    "DFlashBackbone",
    "DominoHead",
    "Drafter",
    "DrafterFormatError",
    "DrafterSpec",
    "check_fits_target",
    "default_target_layer_ids",
    "load_tensors",
    "read_spec",
    "write_checkpoint",
]
