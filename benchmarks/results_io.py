"""How every benchmark here records a run: NAME.json with everything it measured and
NAME.md with a title, a few lines on what was run, and one table (benchmarks/results/
keeps the ones quoted in the README and the issues)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path


def command_line() -> str:
    """The command that is running, as a person would type it again."""
    return shlex.join(["python", *sys.argv])


def markdown_table(header: list[str], rows: list[list[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def write_results(
    out: Path,
    name: str,
    payload: dict,
    header: list[str],
    rows: list[list[object]],
    intro: list[str] | None = None,
    outro: list[str] | None = None,
) -> str:
    """Write out/NAME.json (payload; paths and other objects as strings) and out/NAME.md
    (intro, a blank line, the table, outro); return the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(payload, indent=1, default=str))
    lines = [*intro, ""] if intro else []
    text = "\n".join(lines + markdown_table(header, rows) + (outro or [])) + "\n"
    (out / f"{name}.md").write_text(text)
    return text
