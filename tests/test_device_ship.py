"""Shipping large files to the GPU machine in chunks (scripts/device_pack.sh, run here,
and scripts/device_unpack.sh, run there): every chunk fits a call beside the working
tree, nothing appears before all have arrived, and a damaged chunk is refused."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[1]


def tree_bytes() -> int:
    """The working tree's size as device_pack.sh counts it (tracked and unignored files)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split("\n")  # fmt: skip
    return sum((ROOT / f).stat().st_size for f in set(listed) if f and (ROOT / f).is_file())


# A call's limit for the tests: 8 MiB beside the working tree (the device's is 64 MiB), so
# that the payloads below take several chunks whatever the tree weighs.
LIMIT = tree_bytes() + 8 * 1024 * 1024
MARGIN = 256 * 1024  # for the tree's growth (the device's: 8 MiB)


def _run(script: str, *args: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / script), *args],
        cwd=cwd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
    )


def test_files_arrive_whole_after_the_last_chunk(tmp_path):
    payload = tmp_path / "payload"
    payload.mkdir()
    (payload / "big.bin").write_bytes(os.urandom(20 * 1024 * 1024))
    (payload / "small.txt").write_text("hello")
    env = {
        "SHIP_DIR": str(tmp_path / "ship"),
        "SHIP_LIMIT": str(LIMIT),
        "SHIP_MARGIN": str(MARGIN),
        "SHIP_STORE": str(tmp_path / "store"),
    }
    packed = _run("device_pack.sh", str(payload), cwd=ROOT, env=env)
    assert packed.returncode == 0, packed.stderr
    chunks = sorted(int(p.name) for p in (tmp_path / "ship").iterdir())
    assert len(chunks) >= 3
    # What travels per call: the working tree plus one chunk, under the limit.
    pieces = [(tmp_path / "ship" / str(c) / "piece").stat().st_size for c in chunks]
    assert all(tree_bytes() + piece < LIMIT for piece in pieces)

    device = tmp_path / "device"
    device.mkdir()
    arrived = device / str(payload).lstrip("/")
    for chunk in chunks[:-1]:
        step = _run("device_unpack.sh", str(chunk), cwd=device, env=env)
        assert step.returncode == 0 and "SHIP_PARTIAL" in step.stdout, step.stdout + step.stderr
        assert not arrived.exists()
    last = _run("device_unpack.sh", str(chunks[-1]), cwd=device, env=env)
    assert "SHIP_OK" in last.stdout, last.stdout + last.stderr
    assert (arrived / "big.bin").read_bytes() == (payload / "big.bin").read_bytes()
    assert (arrived / "small.txt").read_text() == "hello"


def test_a_damaged_chunk_is_refused(tmp_path):
    payload = tmp_path / "payload.bin"
    payload.write_bytes(os.urandom(9 * 1024 * 1024))
    env = {
        "SHIP_DIR": str(tmp_path / "ship"),
        "SHIP_LIMIT": str(LIMIT),
        "SHIP_MARGIN": str(MARGIN),
        "SHIP_STORE": str(tmp_path / "store"),
    }
    assert _run("device_pack.sh", str(payload), cwd=ROOT, env=env).returncode == 0
    chunks = sorted(int(p.name) for p in (tmp_path / "ship").iterdir())
    piece = tmp_path / "ship" / "1" / "piece"
    data = bytearray(piece.read_bytes())
    data[100] ^= 0xFF
    piece.write_bytes(bytes(data))
    for chunk in chunks:
        step = _run("device_unpack.sh", str(chunk), cwd=tmp_path, env=env)
    assert step.returncode == 4 and "SHIP_CORRUPT" in step.stderr
