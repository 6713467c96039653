"""Pipeline schedules as tables: valid, within their memory promise, and with the bubble theory says.

The bubble is measured by replaying each table (pp_simulate), never restated from the formula.
"""
import pandas as pd
import pytest

from refimpl.mesh import LayoutError
from refimpl.parallel.pp.schedules import SCHEDULES, bubble_fraction, bubble_over_ideal, schedule_table
from refimpl.parallel.pp.simulate import (
    ScheduleError,
    check_table,
    idle_fraction,
    in_flight,
    simulate,
    simulated_bubble,
)

SIZES = [(2, 1), (2, 2), (2, 4), (3, 3), (3, 5), (4, 1), (4, 2), (4, 4), (4, 8), (8, 16)]


def layouts():
    for p, m in SIZES:
        for schedule in SCHEDULES:
            for v in ((1, 2, 3) if schedule == "interleaved" else (1,)):
                if schedule != "interleaved" or m % p == 0:
                    yield p, m, schedule, v


@pytest.mark.parametrize("p,m,schedule,v", list(layouts()))
def test_every_table_is_a_valid_schedule(p, m, schedule, v):
    check_table(schedule_table(p, m, schedule, v), p, m, schedule, v)


@pytest.mark.parametrize("p,m,schedule,v", list(layouts()))
def test_replayed_bubble_equals_the_closed_form(p, m, schedule, v):
    measured = simulated_bubble(p, m, schedule, v)
    if schedule == "zb-h1" and m < p:
        # ZB-H1's (p-1)/(3m+p-1) assumes a steady state; with m < p the step is longer.
        assert measured > bubble_fraction(p, m, schedule, v)
    else:
        assert measured == pytest.approx(bubble_fraction(p, m, schedule, v), abs=1e-12)


def test_one_f_one_b_reads_like_the_diagram():
    table = schedule_table(4, 6, "1f1b")
    assert table[0] == ["F0", "F1", "F2", "F3", "B0", "F4", "B1", "F5", "B2", "B3", "B4", "B5"]
    assert table[3] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "B4", "F5", "B5"]
    assert schedule_table(4, 2, "1f1b")[0] == ["F0", "F1", "B0", "B1"]  # m < p: warm-up capped at m


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (8, 16)])
def test_memory_promises_are_tight(p, m):
    # GPipe holds all m; 1F1B exactly p - stage; ZB-H1 uses its room of p on every stage.
    peaks = {s: [max(in_flight(a)) for a in schedule_table(p, m, s)] for s in ("gpipe", "1f1b", "zb-h1")}
    assert peaks == {"gpipe": [m] * p, "1f1b": [p - s for s in range(p)], "zb-h1": [p] * p}


def test_zero_bubble_beats_1f1b_and_interleaving_shrinks_the_bubble():
    p, m = 4, 8
    one_f_one_b = simulated_bubble(p, m, "1f1b")
    assert simulated_bubble(p, m, "zb-h1") < simulated_bubble(p, m, "interleaved", 2) < one_f_one_b
    assert simulated_bubble(p, m, "interleaved", 4) < simulated_bubble(p, m, "interleaved", 2)


def test_zero_bubble_defers_weight_gradients_into_the_last_stages_tail():
    last = schedule_table(4, 8, "zb-h1")[3]
    # The last stage never waits for a gradient, so it runs F,B pairs and lets W's pile up to p.
    assert last[:8] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"] and last[8] == "W0"


def test_narayanan_normalisation_is_bubble_time_over_ideal_time():
    for p, m in [(4, 4), (8, 4), (4, 16)]:
        slots = simulate(schedule_table(p, m, "1f1b"), F=1, B=2)
        step = max(s.end for s in slots)
        ideal = 3 * m
        assert bubble_over_ideal(p, m, "1f1b") == pytest.approx((step - ideal) / ideal)
        assert bubble_over_ideal(p, m, "1f1b") == pytest.approx((p - 1) / m)


def test_bubble_does_not_depend_on_the_forward_backward_ratio_for_1f1b():
    table = schedule_table(4, 8, "1f1b")
    assert idle_fraction(simulate(table, F=1, B=2)) == pytest.approx(idle_fraction(simulate(table, F=1, B=3)))


@pytest.mark.parametrize("bad,why", [
    ([["F0", "B0", "F1", "B1"], ["F1", "B1", "F0", "B0"]], "deadlock"),
    ([["F0", "B0", "F1", "B1"], ["B0", "F0", "F1", "B1"]], "before its F"),
    ([["F0", "F1", "B0", "B1"], ["F0", "B0", "F1"]], "exactly once"),
    ([["F0", "F1", "F1", "B0", "B1"], ["F0", "B0", "F1", "B1"]], "exactly once"),
])
def test_checker_rejects_broken_tables(bad, why):
    with pytest.raises(ScheduleError, match=why):
        check_table(bad, 2, 2, "1f1b")


def test_checker_rejects_too_many_in_flight():
    with pytest.raises(ScheduleError, match="in flight"):
        check_table(schedule_table(4, 8, "gpipe"), 4, 8, "1f1b")  # GPipe's table breaks 1F1B's promise
    table = schedule_table(4, 8, "zb-h1")
    greedy = [["F%d" % i for i in range(8)] + [x for i in range(8) for x in ("B%d" % i, "W%d" % i)]
              for _ in range(4)]
    check_table(table, 4, 8, "zb-h1")
    with pytest.raises(ScheduleError, match="in flight"):
        check_table(greedy, 4, 8, "zb-h1")


def test_simulator_adds_communication_latency_to_cross_stage_waits():
    table = schedule_table(2, 1, "gpipe")
    assert max(s.end for s in simulate(table, F=1, B=1, comm=0.5)) == 5.0  # F, c, F, B, c, B


@pytest.mark.parametrize("args", [(4, 6, "interleaved", 2), (4, 4, "1f1b", 2), (4, 4, "pipedream")])
def test_layouts_that_cannot_work_raise_one_line(args):
    with pytest.raises(LayoutError) as err:
        schedule_table(*args)
    assert "\n" not in str(err.value)


def test_gantt_has_one_bar_per_action():
    from refimpl.plots import pipeline_gantt

    slots = simulate(schedule_table(3, 4, "zb-h1"), F=1, B=1, W=1)
    fig = pipeline_gantt(pd.DataFrame([s.__dict__ for s in slots]))
    assert sum(len(trace.x) for trace in fig.data) == 3 * 4 * 3
    assert {trace.name for trace in fig.data} == {"forward", "backward", "weight grad"}
