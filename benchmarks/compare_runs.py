"""One method of one harness run over one method of another, prompt by prompt.

    python benchmarks/compare_runs.py AFTER/harness.json METHOD BEFORE/harness.json METHOD

For a change measured as two harness runs on the same prompts back to back (the package
before the change in one, after it in the other): accept length and decode throughput
of the first over the second, with paired bootstrap 95% intervals over the prompts
(harness.compare). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from harness import compare  # benchmarks/ is this script's folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("method")
    parser.add_argument("base_run", type=Path)
    parser.add_argument("base_method")
    args = parser.parse_args()
    mine = json.loads(args.run.read_text())["records"][args.method]
    theirs = json.loads(args.base_run.read_text())["records"][args.base_method]
    if sorted(mine) != sorted(theirs) or any(len(mine[s]) != len(theirs[s]) for s in mine):
        raise SystemExit("the two runs did not measure the same sets and prompts")
    label = f"{args.base_run.parent.name}:{args.base_method}"
    result = compare({args.method: mine, label: theirs}, args.method, label)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
