"""The plugin's capture helper keeps Python's garbage collector off inside a capture and
puts it back after (CPU: torch.cuda.graph stood in for by a recorder; the real capture
under forced collections is tests/gpu/test_cuda_graphs.py)."""

from __future__ import annotations

import gc
from contextlib import contextmanager

import pytest

from vllm_dominotree import cuda_graphs


@pytest.fixture
def recorded(monkeypatch):
    """torch.cuda.graph replaced by a recorder of what it was given and of whether the
    collector ran automatically inside it."""
    seen = {}

    @contextmanager
    def graph(g, pool=None):
        seen.update(graph=g, pool=pool, collecting_inside=gc.isenabled())
        yield

    monkeypatch.setattr(cuda_graphs.torch.cuda, "graph", graph)
    was = gc.isenabled()
    yield seen
    if was:
        gc.enable()
    else:
        gc.disable()


@pytest.mark.parametrize("enabled_before", [True, False])
def test_collector_off_inside_and_as_before_after(recorded, enabled_before):
    if enabled_before:
        gc.enable()
    else:
        gc.disable()
    with cuda_graphs.capture("g", pool="p"):
        assert not gc.isenabled()
    assert recorded == {"graph": "g", "pool": "p", "collecting_inside": False}
    assert gc.isenabled() == enabled_before


def test_collector_back_on_when_the_capture_raises(recorded):
    gc.enable()
    with pytest.raises(RuntimeError, match="capture failed"), cuda_graphs.capture("g"):
        raise RuntimeError("capture failed")
    assert gc.isenabled()
