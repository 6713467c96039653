"""Every benchmark's verdict in one place: a ratio (ours / PyTorch's, or the reverse for a
bandwidth), the goal it is held to, and whether it holds.

Each script in `scripts/bench_*.py` still prints its own detail and stays runnable alone; beside
that it calls `record` once per ratio, which appends one row to a JSON file. `make bench` runs the
scripts one after another and then `scripts/bench_table.py`, which reads the file back and prints
one markdown table, so a reader sees where the project stands without scrolling through eight
reports. The file is a JSON list (not one object per script) so that two runs of the same script
keep both rows: the table shows the latest row of each name.

Where the rows go: `$REFIMPL_BENCH_RATIOS`, else `profiles/bench_ratios.json` (profiles/ is the
folder runs write into and git ignores).
"""
from __future__ import annotations

import json
import operator
import os
import time
from pathlib import Path

# A goal is "<= 1.0" (a time or a peak: ours at most PyTorch's) or ">= 0.9" (a bandwidth), or
# "n/a here" when the goal only applies on other hardware (the row's note says why): the ratio is
# still shown, and counted neither as holding nor as short.
_COMPARE = {"<=": operator.le, ">=": operator.ge}
NOT_HERE = "n/a here"


def ratios_path() -> Path:
    return Path(os.environ.get("REFIMPL_BENCH_RATIOS", "profiles/bench_ratios.json"))


def parse_goal(goal: str) -> tuple[str, float]:
    """'<= 1.05' -> ('<=', 1.05); anything else is refused in one line."""
    sign, _, number = goal.strip().partition(" ")
    if sign not in _COMPARE:
        raise ValueError(f"a goal reads '<= X' or '>= X', not {goal!r}")
    return sign, float(number)


def holds(value: float, goal: str) -> bool | None:
    if goal == NOT_HERE:
        return None
    sign, bound = parse_goal(goal)
    return bool(_COMPARE[sign](float(value), bound))   # a numpy bool is not JSON


def record(name: str, value: float, goal: str, *, script: str, note: str = "") -> dict:
    """Append one ratio to the log and return its row. `note` says what was measured (ranks,
    size, load average) so that a figure in the table can be traced to its run."""
    row = {"name": name, "value": float(value), "goal": goal, "holds": holds(value, goal),
           "script": script, "note": note, "load_avg": round(os.getloadavg()[0], 2),
           "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    path = ratios_path()
    rows = json.loads(path.read_text()) if path.exists() else []
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows + [row], indent=1) + "\n")
    return row


def latest(rows: list[dict]) -> list[dict]:
    """The last row of each name, in the order the names first appeared."""
    last = {}
    for row in rows:
        last.pop(row["name"], None)     # re-inserted: a name keeps its latest position
        last[row["name"]] = row
    return list(last.values())


def markdown_table(rows: list[dict]) -> str:
    lines = ["| ratio | value | goal | holds | script | run |", "|---|---:|---|:---:|---|---|"]
    for r in latest(rows):
        run = f"{r['note']}; load {r['load_avg']}" if r["note"] else f"load {r['load_avg']}"
        verdict = "–" if r["holds"] is None else "yes" if r["holds"] else "**no**"
        lines.append(f"| {r['name']} | {r['value']:.3f} | {r['goal']} | "
                     f"{verdict} | {r['script']} | {run} |")
    return "\n".join(lines)
