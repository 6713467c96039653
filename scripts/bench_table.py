"""The last step of `make bench`: one markdown table of every ratio the bench scripts recorded
(refimpl.lab.measure.ratio_log), its goal, and whether it holds.

    .venv/bin/python scripts/bench_table.py            # reads profiles/bench_ratios.json
    .venv/bin/python scripts/bench_table.py --reset    # empties it (make bench does, before the runs)
"""
from __future__ import annotations

import argparse
import json
import sys

from refimpl.lab.measure.ratio_log import latest, markdown_table, ratios_path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reset", action="store_true", help="remove the recorded ratios and exit")
    args = p.parse_args(argv)
    path = ratios_path()
    if args.reset:
        path.unlink(missing_ok=True)
        return 0
    if not path.exists():
        print(f"no ratios recorded yet ({path}): run the scripts/bench_*.py first", file=sys.stderr)
        return 1
    rows = json.loads(path.read_text())
    print(markdown_table(rows))
    shown = latest(rows)
    failing = sum(r["holds"] is False for r in shown)
    elsewhere = sum(r["holds"] is None for r in shown)
    print(f"\n{len(shown)} ratios, {failing} short of their goal"
          + (f", {elsewhere} with a goal for other hardware (n/a here)" if elsewhere else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
