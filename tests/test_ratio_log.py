"""The bench table's log: a goal is checked in the direction it names, the latest row of a name
wins, and a malformed goal is refused."""
import json

import pytest

from refimpl.lab.measure import ratio_log


def test_goal_direction_and_bad_goal():
    assert ratio_log.holds(0.95, ">= 0.9") and not ratio_log.holds(0.85, ">= 0.9")
    assert ratio_log.holds(1.0, "<= 1.0") and not ratio_log.holds(1.01, "<= 1.0")
    with pytest.raises(ValueError, match="goal reads"):
        ratio_log.parse_goal("< 1")


def test_record_appends_and_table_keeps_latest(tmp_path, monkeypatch):
    monkeypatch.setenv("REFIMPL_BENCH_RATIOS", str(tmp_path / "r.json"))
    ratio_log.record("a", 1.2, "<= 1.0", script="s")
    ratio_log.record("b", 0.95, ">= 0.9", script="s")
    ratio_log.record("a", 0.9, "<= 1.0", script="s")
    rows = json.loads((tmp_path / "r.json").read_text())
    assert [r["name"] for r in rows] == ["a", "b", "a"]      # every run kept in the file
    table = ratio_log.markdown_table(rows).splitlines()
    assert len(table) == 4 and table[2].startswith("| b |") and "| 0.900 |" in table[3]
    assert "**no**" not in "\n".join(table)                  # a's failing row was superseded


def test_a_goal_for_other_hardware_is_neither_met_nor_short(tmp_path, monkeypatch):
    monkeypatch.setenv("REFIMPL_BENCH_RATIOS", str(tmp_path / "r.json"))
    row = ratio_log.record("c", 1.06, ratio_log.NOT_HERE, script="s", note="why")
    assert row["holds"] is None
    line = ratio_log.markdown_table([row]).splitlines()[2]
    assert "| 1.060 | n/a here | – |" in line and "**no**" not in line and "yes" not in line
