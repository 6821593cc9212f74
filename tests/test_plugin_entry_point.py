"""The package is a vLLM general plugin that loads cleanly through vLLM's own loader."""

from __future__ import annotations

import subprocess
import sys


def test_vllm_loads_the_plugin():
    code = (
        "import vllm_dominotree, vllm.plugins as p\n"
        "plugins = p.load_plugins_by_group('vllm.general_plugins')\n"
        "assert plugins['dominotree'] is vllm_dominotree.register, plugins\n"
        "p.load_general_plugins()\n"
        "print('loaded', sorted(plugins))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"VLLM_PLUGINS": "dominotree", "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "loaded ['dominotree']" in out.stdout


def test_the_plugin_refuses_a_vllm_it_was_not_built_for():
    import pytest

    from vllm_dominotree.patches import UnsupportedVLLMVersion, check_vllm_version

    check_vllm_version("0.32.0")
    check_vllm_version("0.32.1")
    with pytest.raises(
        UnsupportedVLLMVersion, match=r"found vLLM 0\.33\.0; install vllm==0\.32\.0"
    ):
        check_vllm_version("0.33.0")


def test_only_dominotree_engines_run_the_v1_runner(monkeypatch):
    """The runner choice is per engine config: with V2 asked for process-wide, a
    DominoTree config still answers V1 and any other config gets vLLM's own answer (so a
    baseline engine in the same process keeps V2)."""
    from types import SimpleNamespace

    from vllm.config.vllm import VllmConfig

    from vllm_dominotree.patches import apply_frontend_patches

    apply_frontend_patches()
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")

    def config(extra):
        return SimpleNamespace(
            additional_config=extra,
            watermark_config=None,
            attention_config=SimpleNamespace(hisparse_config=None),
        )

    choose = VllmConfig.use_v2_model_runner.fget
    assert choose(config(None)) is True
    assert choose(config({"other_plugin": 1})) is True
    assert choose(config({"dominotree": {"budget": 16}})) is False
