"""Every GPU test runs in some part of `scripts/gpu_jobs.sh suite` (tests, bf16, memory,
tp2): the suite names its jobs' tests one by one, so a test added to tests/gpu and not
to a job would never run on the device, silently."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parents[1]


def suite_section() -> str:
    """The `suite)` case of gpu_jobs.sh, its path variables ($e, $s, ...) expanded and its
    continued lines joined."""
    text = (ROOT / "scripts" / "gpu_jobs.sh").read_text()
    section = text[text.index("\n  suite)\n") : text.index("\n  bf16-variant)\n")]
    definition = r"^\s*(\w+)=(tests/gpu/\S+\.py)\s*$"
    for name, path in re.findall(definition, section, re.M):
        section = re.sub(rf"\${name}\b", path, section)
    return re.sub(definition, "", section, flags=re.M).replace("\\\n", "")


def gpu_tests() -> list[tuple[str, str]]:
    """(file, test function) for every test function of tests/gpu."""
    found = []
    for path in sorted((ROOT / "tests" / "gpu").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        rel = str(path.relative_to(ROOT))
        found += [
            (rel, node.name)
            for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
        ]
    return found


def covered(section: str, path: str, name: str) -> bool:
    """Named (`file::test`, any of its parameters), or its whole file is a job's (the
    file alone, or with pytest's -k selecting among its tests)."""
    if re.search(rf"{re.escape(path)}::{name}(?!\w)", section):
        return True
    return re.search(rf"{re.escape(path)}(?=[\s\"'])", section) is not None


def test_every_gpu_test_is_in_the_suite():
    section = suite_section()
    tests = gpu_tests()
    assert len(tests) > 40  # the parsing found the GPU tests
    missing = [f"{path}::{name}" for path, name in tests if not covered(section, path, name)]
    assert not missing, f"GPU tests in no job of `gpu_jobs.sh suite`: {missing}"


def test_a_test_left_out_of_the_suite_is_found():
    section = suite_section()
    assert covered(section, "tests/gpu/test_engine_gpu.py", "test_greedy_eager")
    assert not covered(section, "tests/gpu/test_engine_gpu.py", "test_not_in_any_job")
