"""The SmolLM2 drafter's learning curve: offline acceptance on the evaluation sets against
its H200 training minutes, from the evaluate.py runs recorded beside it; writes
curve.json and curve.png here. Run from the project root:
    .venv/bin/python benchmarks/results/smollm2_learning_curve/make.py"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).parent
RESULTS = HERE.parent
# (cumulative H200 training minutes, what was added, evaluation file, drafter row)
SETS_05, SETS_05C = "h200_2026-12-05/eval_sets.json", "h200_2026-12-05c/train/train_arms.json"
POINTS = [
    (7.3, "templates, 12000 prompts (2026-11-30)", SETS_05, 0),
    (8.3, "+1 min, 3000 prompts, 75% self-written, seed 0", SETS_05, 1),
    (8.3, "(the same drafter, evaluated again)", SETS_05C, 0),
    (
        11.8,
        "+3.5 min, 5000 prompts, 75% self-written, seed 2",
        "h200_2026-12-05c/train/train_arms.json",
        1,
    ),
]


def rows(name: str) -> list[dict]:
    data = json.loads((RESULTS / name).read_text())
    return data.get("sets", data)["rows"]


curve = []
for minutes, added, name, index in POINTS:
    row = rows(name)[index]
    curve.append(
        {
            "minutes": minutes,
            "added": added,
            "source": name,
            "anchors": row["anchors"],
            "first_draft": row["first_draft_corrected"],
            "chain_accept_corrected": row["chain_accept_corrected"],
        }
    )
(HERE / "curve.json").write_text(json.dumps(curve, indent=1) + "\n")
fig, ax = plt.subplots(figsize=(5, 3.2))
ax.plot([p["minutes"] for p in curve], [p["chain_accept_corrected"] for p in curve], "o-")
ax.axhline(3.0, ls="--", c="grey", lw=1)
ax.text(7.4, 2.92, "goal (conditional-16, engine): 3.0", fontsize=8, c="grey", va="top")
ax.set_xlabel("H200 training minutes (cumulative)")
ax.set_ylabel("chain accept length (offline)")
ax.set_title("SmolLM2-135M drafter on the four evaluation sets", fontsize=9)
fig.tight_layout()
fig.savefig(HERE / "curve.png", dpi=120)
for p in curve:
    print(p["minutes"], p["first_draft"], p["chain_accept_corrected"], p["source"])
