"""Running Triton kernels on the CPU: code in a fresh interpreter with TRITON_INTERPRET=1
(Triton reads it when a kernel is defined, so not inside this test process, where
other tests have loaded the kernels compiled)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = str(Path(__file__).parent)


def run_interpreted(code: str, timeout: int = 900) -> str:
    """Runs `code` (tests/ on its path) under Triton's interpreter; it must end by
    printing "ok". Returns its output."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTS, env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert out.stdout.strip().endswith("ok"), out.stdout[-2000:]
    return out.stdout
