"""The README's main command end to end, on the toy pair (the SmolLM2 pair is the same
code with a bigger model): every mode of the reference decoder and both vLLM engines,
one request at a time and in one batch, each checked against the target alone by the
demo itself (it exits with an error when an output differs)."""

from __future__ import annotations

import os
import re
import subprocess
import sys


def test_the_main_command_runs_and_compares_every_mode(tmp_path):
    command = [sys.executable, "-m", "vllm_dominotree.demo", "--pair", "toy"]
    command += ["--max-new-tokens", "12", "--workdir", str(tmp_path)]
    # As from a shell: without the LD_PRELOAD that vLLM set in this process for the
    # engines of earlier tests (vllm/platforms/cpu.py).
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    run = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    # Three prompts, each through the four modes of the reference decoder, all identical.
    assert out.count("(identical in every mode)") == 3
    for mode in ("ar", "chain", "marginal", "conditional"):
        assert len(re.findall(rf"^{mode} +\d+\.\d\d +\d+", out, re.M)) == 3, mode
    # vLLM: both engines, both ways of sending the prompts; the plugin's line gives its
    # speed over plain decoding for each and its accept length.
    # Each engine on its OpenMP runtime (openmp.py): Intel's for speculation, vLLM's
    # default (GNU) for plain decoding.
    plain = re.search(
        r"^vllm no-spec +\d+ tok/s one at a time +\d+ tok/s 3 in one batch +"
        r"OpenMP: GNU OpenMP \(vLLM's default\)$",
        out,
        re.M,
    )
    assert plain, out[-2000:]
    tree = re.search(
        r"^vllm dominotree +\d+ tok/s one at a time \((\d+\.\d\d)x\) +\d+ tok/s 3 in one batch "
        r"\((\d+\.\d\d)x\) +OpenMP: Intel OpenMP \(.+libiomp5.so\) +accept length (\d+\.\d\d)",
        out,
        re.M,
    )
    assert tree, out[-2000:]
    assert all(float(x) > 0 for x in tree.groups()[:2]) and float(tree[3]) >= 1
    assert "(identical with and without the plugin)" in out
