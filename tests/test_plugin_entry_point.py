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
