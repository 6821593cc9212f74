"""Patch (scoped): the classes vLLM's worker and runner construct by name.

Why: `CPUWorker.init_device` builds `CPUModelRunner` and the V1 runner builds
`DFlashProposer` for method "dflash", both by module-level name with no hook.
How: while the DominoTree CPU worker initialises its device (engine/cpu_worker.py) and
while the tree runner initialises (engine/runner.py), those module attributes point at
the DominoTree classes; they are restored right after, so nothing else in the process
sees the change.
Removal: when vLLM gives CPUWorker a `_make_model_runner` hook (the CUDA Worker has one)
and the runner a proposer factory.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def swapped(module, name: str, replacement):
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        yield
    finally:
        setattr(module, name, original)
