"""Pipeline schedules as tables: valid, within their memory promise, and with the bubble theory says.

The bubble is measured by replaying each table (pp_simulate), never restated from the formula.
"""
import pandas as pd
import pytest

from refimpl.lab.measure.pp_replay import bubble_over_ideal
from refimpl.lab.pipeline.simulate import (
    ScheduleError,
    check_table,
    idle_fraction,
    in_flight,
    simulate,
    simulated_bubble,
)
from refimpl.lab.pipeline.speedups import whole_backwards
from refimpl.mesh import LayoutError
from refimpl.parallel.pp.schedules import bubble_fraction, parse_entry, schedule_table, schedules

SIZES = [(2, 1), (2, 2), (2, 4), (3, 3), (3, 5), (4, 1), (4, 2), (4, 4), (4, 8), (8, 16)]


def layouts():
    for p, m in SIZES:
        for schedule in schedules():
            interleaved = schedule.startswith("interleaved")
            for v in ((1, 2, 3) if interleaved else (1,)):
                if (not interleaved or m % p == 0) and (schedule != "dualpipev" or m >= 2 * p):
                    yield p, m, schedule, v


@pytest.mark.parametrize("p,m,schedule,v", list(layouts()))
def test_every_table_is_a_valid_schedule(p, m, schedule, v):
    check_table(schedule_table(p, m, schedule, v), p, m, schedule, v)


@pytest.mark.parametrize("p,m,schedule,v", list(layouts()))
def test_replayed_bubble_equals_the_closed_form(p, m, schedule, v):
    measured = simulated_bubble(p, m, schedule, v)
    if schedule == "zb-h1" and m < p or schedule == "zbv" and m < 2 * p - 1:
        # ZB-H1's (p-1)/(3m+p-1) and ZB-V's assume a steady state; with fewer micro-batches the
        # step is longer.
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


@pytest.mark.parametrize("args", [(4, 6, "interleaved", 2), (4, 4, "1f1b", 2), (4, 4, "pipedream"),
                                  (4, 6, "interleaved-zb", 2), (2, 3, "dualpipev"), (2, 4, "zbv", 3)])
def test_layouts_that_cannot_work_raise_one_line(args):
    with pytest.raises(LayoutError) as err:
        schedule_table(*args)
    assert "\n" not in str(err.value)


def test_gantt_has_one_bar_per_action():
    from refimpl.lab.plots import pipeline_gantt

    slots = simulate(schedule_table(3, 4, "zb-h1"), F=1, B=1, W=1)
    fig = pipeline_gantt(pd.DataFrame([s.__dict__ for s in slots]))
    assert sum(len(trace.x) for trace in fig.data) == 3 * 4 * 3
    assert {trace.name for trace in fig.data} == {"forward", "backward", "weight grad"}


# --- the frontier: interleaved-zb, zbv, dualpipev ----------------------------------------------------

@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 8), (4, 12), (8, 16)])
def test_frontier_bubbles_order_as_the_theory_says(p, m):
    bubble = {s: simulated_bubble(p, m, s, 2 if s.startswith("interleaved") else 1) for s in schedules()}
    # the B/W split removes most of 1F1B's bubble; on two chunks it shrinks twice again
    assert bubble["zbv"] < bubble["zb-h1"] < bubble["1f1b"]
    assert bubble["interleaved-zb"] < bubble["interleaved"] < bubble["1f1b"]
    # the V's bubble is interleaved-zb's at v = 2, with 1F1B's memory: 2p chunks of half a stage
    assert bubble["zbv"] == pytest.approx(bubble["interleaved-zb"])
    assert max(max(in_flight(r)) for r in schedule_table(p, m, "zbv")) == 2 * p
    assert max(max(in_flight(r)) for r in schedule_table(p, m, "interleaved-zb", 2)) > 2 * p
    # a pair waits for both its inputs: dualpipev idles one chunk unit per rank more than zbv
    assert bubble["zbv"] < bubble["dualpipev"] <= bubble["zb-h1"]


def test_the_v_places_first_and_last_piece_on_rank_0():
    from refimpl.parallel.pp.schedules import piece_of, rank_of

    assert [[piece_of(r, c, 4, "v") for c in (0, 1)] for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [rank_of(k, 4, "v") for k in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    zbv = schedule_table(4, 8, "zbv")
    assert zbv[3][:2] == ["F0.0", "F0.1"]     # the V's bottom: chunk 0's output stays on the rank


def test_dualpipev_pairs_a_forward_with_the_other_chunks_backward():
    table = schedule_table(4, 8, "dualpipev")
    pairs = [e for row in table for e in row if "&" in e]
    assert pairs and all(e[0] == "F" and "&B" in e for e in pairs)
    for e in pairs:
        f, b = e.split("&")
        assert f[-1] != b[-1]                        # F of one chunk, B of the other
    # per rank 2(m - 2p + r + 1) in the steady state (the V's bottom runs its first two apart), and
    # p - r - 1 more while chunk 1 still has forwards: m = 8, p = 4
    assert [sum("&" in e for e in row) for row in table] == [2 * (r + 1) + 3 - r - (r == 3) for r in range(4)]


def test_every_frontier_table_runs_under_one_tag_because_receives_follow_the_sender():
    from refimpl.lab.pipeline.simulate import inbox, messages, posting_order_mismatch

    for s in ("gpipe", "1f1b", "interleaved", "zb-h1", "interleaved-zb"):
        assert posting_order_mismatch(schedule_table(4, 8, s, 2 if s.startswith("inter") else 1)) is None
    # On a V each link carries activations one way and gradients the other for both chunks, and the
    # receiver's own row wants them in another order than the sender sends them: posting the
    # receives in the row's order would pair the wrong tensors under NCCL. The runner follows inbox.
    for s in ("zbv", "dualpipev"):
        table = schedule_table(4, 8, s)
        assert "NCCL pairs them by posting order" in posting_order_mismatch(table, "v")
        sent, received = messages(table, "v")
        for r in range(4):
            for src, order in inbox(table, r, "v").items():
                assert order == sent[(src, r)] and sorted(order) == sorted(received[(src, r)])


def test_an_overlapped_pair_is_one_f_and_one_b():
    table = schedule_table(2, 4, "dualpipev")
    broken = [[e.replace("F2.1&B0.0", "B0.0&F2.1") for e in row] for row in table]
    with pytest.raises(ScheduleError, match="one F and one B"):
        check_table(broken, 2, 4, "dualpipev")


def test_pipedream_without_a_flush_needs_the_forwards_weights():
    from refimpl.lab.pipeline import weight_stashing

    rows = schedule_table(4, 8, "1f1b")
    # 1F1B's steady state: stage s has p - s inputs in flight and updates p - s - 1 times between
    # an input's F and its B
    assert [weight_stashing.stash_versions(r) for r in rows] == [4, 3, 2, 1]
    assert [weight_stashing.updates_between(r)[7] for r in rows] == [3, 2, 1, 0]
    stale = weight_stashing.stale_gradient_error(3)
    assert stale["stashed"] < 1e-12 < 1e-4 < stale["current weights"]
    adjacent = weight_stashing.stale_gradient_error(0)
    assert max(adjacent.values()) < 1e-12          # no update in between: both are exact


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved", 2), ("zbv", 2), ("dualpipev", 2)])
def test_replay_with_each_actions_own_time_reproduces_a_run_that_follows_its_table(schedule, v):
    """A 'run' made by the simulator itself with uneven action times (no two alike): replayed
    step by step with those times, its idle share comes back exactly; with per-rank means (the
    plain replay) it does not, which is why measure.replayed_steps replays action by action."""
    from refimpl.lab.measure import pp_measure as measure
    from refimpl.parallel.pp.schedules import placement
    table = schedule_table(2, 8, schedule, v)
    texts = [(r, t) for r, row in enumerate(table) for e in row for t in e.split("&")]
    own = {key: 1.0 + (7 * i % 11) / 5 for i, key in enumerate(texts)}
    run = simulate(table, F=0, B=0, W=0, where=placement(schedule), per_action=own)
    slots = pd.DataFrame([{"step": 1, "rank": s.rank, "action": s.action, "start": s.start, "end": s.end}
                          for s in run])
    (step,) = measure.replayed_steps(slots, 2, 8, schedule, v)
    assert step["replayed"] == pytest.approx(step["measured"], abs=1e-12)
    assert abs(measure.simulated_bubble_from(slots, 2, 8, schedule, v) - step["measured"]) > 1e-3


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("dualpipev", 2)])
def test_measured_costs_recover_the_costs_a_run_was_made_with(schedule, v):
    """A 'run' made by the simulator with uneven action times and known costs outside compute (an
    empty action's, a collected message's, a waited-for message's): measure.measured_costs reads
    the same three back from the slots alone, and the step replayed with them and each action's
    time is the run again. So the costs the notebook and bench_bubble put into the replay are the
    ones their definitions say, and a replay that misses a measured bubble misses something else."""
    from refimpl.lab.measure import pp_measure as measure
    from refimpl.parallel.pp.schedules import placement
    table = schedule_table(2, 8, schedule, v)
    texts = [(r, t) for r, row in enumerate(table) for e in row for t in e.split("&")]
    own = {key: 1.0 + (7 * i % 11) / 5 for i, key in enumerate(texts)}
    costs = {"action_cost": 0.1, "recv_cost": 0.3, "comm": 0.5}
    run = simulate(table, F=0, B=0, W=0, where=placement(schedule), per_action=own, **costs)
    slots = pd.DataFrame([{"step": 1, "rank": s.rank, "action": s.action, "start": s.start, "end": s.end}
                          for s in run])
    got = measure.measured_costs(slots, 2, 8, schedule, v)
    assert got == pytest.approx(costs, abs=1e-9)
    (step,) = measure.replayed_steps(slots, 2, 8, schedule, v, got)
    assert step["replayed"] == pytest.approx(step["measured"], abs=1e-9)
    without = measure.replayed_steps(slots, 2, 8, schedule, v, {**got, "recv_cost": 0.0})[0]
    assert without["replayed"] < step["measured"] - 1e-3      # the collected messages are idle time


def _every_table():
    for schedule, v in [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1),
                        ("interleaved-zb", 2), ("zbv", 2), ("dualpipev", 2)]:
        for p in (2, 3, 4):
            for m in (2, 4, 8):
                try:
                    yield schedule, p, m, schedule_table(p, m, schedule, v)
                except LayoutError:
                    continue


def test_posting_in_one_global_order_cannot_hang_under_nccls_rules():
    """Every table on 2-4 stages: the runner's NCCL order (nccl_order.rank_order, one operation at
    a time) finishes when each rank's operations run in posting order and a send waits for its
    receive, on one stream per rank and on one per pair; the ahead-posting it replaced hangs."""
    from refimpl.lab.pipeline import nccl_order
    from refimpl.parallel.pp.schedules import placement
    checked = 0
    for schedule, p, m, table in _every_table():
        where = placement(schedule)
        for one_stream in (True, False):
            assert nccl_order.replay(nccl_order.plans(table, where), one_stream) is None, (schedule, p, m)
        checked += 1
    assert checked >= 40
    one_f_one_b = schedule_table(2, 4, "1f1b")
    stuck = nccl_order.replay(nccl_order.plans(one_f_one_b, "loop", nccl_order.ahead_plan), one_stream=False)
    assert stuck is not None and "('B', 0, 0)" in stuck and "('F', 1, 1)" in stuck   # the cycle of the docstring


def test_the_global_order_is_each_senders_order_and_each_receivers_posting_order():
    """Each rank's part of the order sends in its own production order (simulate.messages) and
    holds every message of the step exactly once."""
    from refimpl.lab.pipeline import nccl_order
    from refimpl.lab.pipeline.simulate import messages
    from refimpl.parallel.pp.schedules import placement
    for schedule, p, m, table in _every_table():
        where = placement(schedule)
        sent, _ = messages(table, where)
        order = nccl_order.global_order(table, where)
        assert sorted(order) == sorted((a, b, msg) for (a, b), msgs in sent.items() for msg in msgs)
        for (a, b), msgs in sent.items():
            assert [msg for src, dst, msg in order if (src, dst) == (a, b)] == msgs, (schedule, p, m)


def test_micro_batch_latency_on_gpipe_by_hand():
    from refimpl.lab.measure.pp_replay import micro_batch_latency, replay

    # GPipe, 2 stages, 2 micro-batches, F = 1, B = 2. Rank 0: F0 [0,1], F1 [1,2]; rank 1: F0 [1,2],
    # F1 [2,3], B0 [3,5], B1 [5,7]; rank 0: B0 [5,7] (after rank 1's B0), B1 [7,9].
    # Micro-batch 0: 0 -> 7, latency 7, own work 1+1+2+2 = 6, waiting 1 (rank 1 runs F1 before
    # B0); micro-batch 1: 1 -> 9, latency 8, waiting 2 (rank 1's B0, then rank 0's B0).
    got = micro_batch_latency(replay(2, 2, "gpipe"))
    assert got.latency.tolist() == [7.0, 8.0] and got.work.tolist() == [6.0, 6.0]
    assert got.waiting.tolist() == [1.0, 2.0] and got.start.tolist() == [0.0, 1.0]
    # one stage under 1F1B (F0 B0 F1 B1): no pipeline, nothing added to a micro-batch's own work
    assert micro_batch_latency(replay(1, 2, "1f1b")).waiting.tolist() == [0.0, 0.0]


def test_a_b_followed_by_its_own_w_is_one_whole_backward():
    # dualpipev, 2 stages, rank 0: F0.0 F1.0 F2.0 F0.1 B0.1 W0.1 F1.1 F3.0&B1.1 W1.1 F2.1&B0.0 W0.0
    # B2.1 W2.1 F3.1&B1.0 W1.0 B3.1 B2.0 W3.1 B3.0 W2.0 W3.0: a B alone or last in an overlapped
    # pair, then its own W, is whole; B3.1, B2.0, B3.0 keep the split (another action between)
    row = [parse_entry(e) for e in schedule_table(2, 4, "dualpipev")[0]]
    assert whole_backwards(row, [True, True]) == {(0, 1), (1, 1), (0, 0), (2, 1), (1, 0)}
    assert whole_backwards(row, [True, False]) == {(0, 0), (1, 0)}   # chunk 1 must keep the split
    # 1F1B has no W: nothing to merge
    assert whole_backwards([parse_entry(e) for e in schedule_table(2, 4, "1f1b")[0]], [True]) == set()
