"""Bad `--speculative-config` at the server boundary: `vllm.entrypoints.openai.api_server`
exits at start-up, before any engine starts, with a message that names the key or the
file (the CPU tests; `vllm serve` parses the same arguments)."""

from __future__ import annotations

import json

import pytest

from vllm_dominotree.demo.toy_pair import PairSpec, write_drafter
from vllm_dominotree.evaluation.server import ApiServer, ServerError

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 180


def start_fails(pair_dirs, tmp_path, speculative_config: str) -> str:
    """Starts the server with this raw option; returns the log of its failed start."""
    args = ["--dtype", "float32", "--max-model-len", "256", "--enforce-eager"]
    server = ApiServer.start(
        pair_dirs["target"],
        tmp_path / "server.log",
        [*args, "--speculative-config", speculative_config],
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    try:
        with pytest.raises(ServerError, match="exited with") as err:
            server.wait_healthy(STARTUP_TIMEOUT_S)
    finally:
        server.stop()
    assert server.proc.returncode != 0
    log = (tmp_path / "server.log").read_text(errors="replace")
    # Refused in process 0: no engine was started for a bad option.
    assert "EngineCore" not in log, str(err.value)
    return log


def dominotree(pair_dirs, **options) -> str:
    return json.dumps({"method": "dominotree", "model": pair_dirs["drafter"], **options})


@pytest.mark.parametrize(
    "make_option, message",
    [
        (lambda d: '{"method": "dominotree", "model": ', "error: argument --speculative-config"),
        (lambda d: dominotree(d, budgett=16), "unknown DominoTree option(s) ['budgett']"),
        (lambda d: dominotree(d, budget="16"), "budget must be a positive integer, got '16'"),
        (lambda d: dominotree(d, scorer=3), "scorer 3 is unknown"),
    ],
    ids=["malformed-json", "unknown-key", "wrong-type", "wrong-value"],
)
def test_bad_speculative_config_fails_at_startup(pair_dirs, tmp_path, make_option, message):
    assert message in start_fails(pair_dirs, tmp_path, make_option(pair_dirs))


def test_missing_drafter_folder_is_named(pair_dirs, tmp_path):
    missing = tmp_path / "no-such-drafter"
    option = json.dumps({"method": "dominotree", "model": str(missing)})
    assert f"{missing}/config.json: not found" in start_fails(pair_dirs, tmp_path, option)


def test_drafter_for_another_target_is_named(pair_dirs, tmp_path):
    other = write_drafter(tmp_path / "drafter", PairSpec(noise=0.8, hidden=32))
    option = json.dumps({"method": "dominotree", "model": str(other)})
    log = start_fails(pair_dirs, tmp_path, option)
    assert "'hidden_size' is 32" in log and str(other) in log
