"""The rank-timeline TensorBoard plugin, through its own WSGI apps (werkzeug's test client).

The logdir holds a real 2-rank gloo run and a synthetic 4-rank, 10-step run (tests/trace_runs.py).
"""
from __future__ import annotations

import json
import re

import pytest
from tensorboard.plugins.base_plugin import TBContext
from werkzeug.test import Client

from refimpl.lab.instrument.labels import PHASES
from refimpl.lab.tb_plugin.plugin import STATIC, RankTimelinePlugin, plotly_js_path
from refimpl.lab.trace.profiling import load_trace, summarize
from tests.trace_runs import BIG_RUN as BIG
from tests.trace_runs import GRAD_NUMEL, shared_logdir
from tests.trace_runs import REAL_RUN as REAL

pytestmark = pytest.mark.ranks   # launches rank processes (make test-fast skips it)


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    return shared_logdir(tmp_path_factory)


@pytest.fixture
def plugin(logdir):
    return RankTimelinePlugin(TBContext(logdir=str(logdir[0])))


def get(plugin, route, expect=200, **query):
    response = Client(plugin.get_plugin_apps()[route]).get(route, query_string=query)
    assert response.status_code == expect, response.get_data(as_text=True)
    return response


def get_json(plugin, route, expect=200, **query):
    return json.loads(get(plugin, route, expect, **query).get_data())


def test_active_and_lists_runs(plugin, tmp_path):
    assert plugin.is_active()
    runs = {r["run"]: r for r in get_json(plugin, "/runs")["runs"]}
    assert runs[REAL]["ranks"] == 2 and runs[REAL]["has_summary"]
    assert runs[BIG]["ranks"] == 4 and not runs[BIG]["has_summary"]
    assert not RankTimelinePlugin(TBContext(logdir=str(tmp_path))).is_active()


def test_timeline_has_every_ranks_phases_and_comms(plugin):
    body = get_json(plugin, "/timeline", run=REAL)
    assert body["ranks"] == [0, 1]
    assert body["steps"] == [1, 2, 3] and body["window"] == [1, 3]   # 4 steps, the first warm-up
    spans = body["spans"]
    for rank in (0, 1):
        for step in (1, 2, 3):
            names = {s["name"] for s in spans if s["rank"] == rank and s["step"] == step}
            assert set(PHASES) | {f"ProfilerStep#{step}"} <= names
    labelled = [s for s in spans if s["row"] == "comm"]
    assert len(labelled) == 2 * 3
    assert all(s["op"] == "all_reduce" and s["bytes"] == GRAD_NUMEL * 4 for s in labelled)
    assert {s["row"] for s in spans} >= {"compute", "comm", "step"}
    assert set(body["colors"]) >= set(PHASES) | {"comm", "idle"}


def test_breakdown_is_refimpl_profiling_summary(plugin, logdir):
    body = get_json(plugin, "/breakdown", run=REAL)
    expected = summarize(load_trace(logdir[0] / REAL))
    for row, want in zip(body["per_rank"], expected.itertuples()):
        assert row["rank"] == want.rank
        for key in ("step_us", "compute_us", "comm_us", "overlap_us", "idle_us"):
            assert row[key] == pytest.approx(getattr(want, key))
    assert len(body["per_step"]) == 3 * 2
    for row in body["per_step"]:
        total = row["compute_frac"] + row["comm_frac"] + row["overlap_frac"] + row["idle_frac"]
        assert total == pytest.approx(1.0)


def test_comm_table_and_memory(plugin, logdir):
    rows = get_json(plugin, "/comm", run=REAL)["rows"]
    assert [(r["op"], r["rank"], r["count"]) for r in rows] == [("all_reduce", 0, 3),
                                                                  ("all_reduce", 1, 3)]
    assert all(r["bytes"] == 3 * GRAD_NUMEL * 4 and r["GB_per_s"] > 0 for r in rows)
    memory = get_json(plugin, "/memory", run=REAL)["ranks"]
    assert [dict(m, rank=r) for r, m in enumerate(res["memory"] for res in logdir[1])] == memory
    assert get_json(plugin, "/memory", run=BIG) == {"ranks": []}


def test_large_runs_are_windowed_by_step(plugin):
    first = get_json(plugin, "/timeline", run=BIG)
    assert first["steps"] == list(range(1, 11)) and first["window"] == [1, 4]
    assert {s["step"] for s in first["spans"]} == {1, 2, 3, 4}
    assert get_json(plugin, "/timeline", run=BIG, steps="7:")["window"] == [7, 10]
    one = get_json(plugin, "/breakdown", run=BIG, steps="5")
    assert {r["step"] for r in one["per_step"]} == {5} and len(one["per_rank"]) == 4
    assert get_json(plugin, "/comm", run=BIG, steps="8:20")["window"] == [8, 10]   # what exists
    get(plugin, "/timeline", expect=400, run=BIG, steps="6:2")
    get(plugin, "/timeline", expect=400, run=BIG, steps="20:30")
    get(plugin, "/timeline", expect=404, run="nb/nothing-here")
    get(plugin, "/comm", expect=404, run="../" * 8 + "etc")


def test_what_a_page_loads_is_bounded_by_the_window_not_the_run(plugin):
    """A 4-rank, 10-step run is served a window at a time: the first page carries 4 steps'
    ranges (step, 3 phases, the labelled all-reduce and its gloo event: 6 per rank and step).
    How long it takes in a browser is measured by scripts/e2e_browser.py, not asserted here."""
    body = get_json(plugin, "/timeline", run=BIG)
    assert len(body["spans"]) == 4 * 4 * 6
    assert len(get_json(plugin, "/breakdown", run=BIG)["per_step"]) == 4 * 4
    assert len(get_json(plugin, "/timeline", run=BIG, steps="1:10")["spans"]) == 4 * 10 * 6


def test_merged_route_gives_one_lane_per_rank(plugin):
    response = get(plugin, "/merged", run=REAL)
    assert "attachment" in response.headers["Content-Disposition"]
    trace = json.loads(response.get_data())
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}


# Anything of the form scheme://host or //host: what a page would need to reach another machine.
ABSOLUTE_URL = re.compile(r"(?:\b[a-z][a-z0-9+.-]*:)?//[\w.-]+", re.I)
# Where a page names what it loads: src/href attributes or properties, imports, fetch, CSS url().
LOAD_TARGET = re.compile(r"""(?:\b(?:src|href)\s*[=:]\s*|\bfrom\s+|\bimport\s*\(\s*"""
                         r"""|\bfetch\s*\(\s*|\burl\s*\(\s*)['"`]?([^'"`)\s]*)""")


def test_served_pages_load_nothing_from_other_hosts(plugin):
    """Our own page, scripts and style contain no absolute URL at all, and every load they name
    is relative (so it resolves to the TensorBoard host). plotly.min.js is third-party: it holds
    URL strings (e.g. for map tiles we never draw), so the static check is only that we serve the
    plotly package's file byte for byte; what it does at run time is checked by the browser test
    (scripts/e2e_browser.py), which fails on any request off 127.0.0.1. TensorBoard's CSP, checked
    last, makes the browser refuse scripts and connections to other hosts in any case."""
    for path in sorted(STATIC.iterdir()):
        text = get(plugin, f"/{path.name}").get_data(as_text=True)
        code = re.sub(r"^\s*//.*$|/\*.*?\*/|<!--.*?-->", "", text, flags=re.M | re.S)  # comments
        assert not ABSOLUTE_URL.findall(code), path.name
        for target in LOAD_TARGET.findall(code):
            assert not re.match(r"[a-z][a-z0-9+.-]*:|//", target, re.I), (path.name, target)
    served = get(plugin, "/plotly.min.js").get_data()
    assert served == plotly_js_path().read_bytes()
    csp = get(plugin, "/index.html").headers["Content-Security-Policy"]
    policy = dict(part.strip().split(" ", 1) for part in csp.split(";") if part.strip())
    for directive in ("default-src", "script-src", "connect-src"):
        assert not ABSOLUTE_URL.search(policy[directive]), (directive, policy[directive])
