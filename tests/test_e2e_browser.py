"""The plugin in headless Chromium, inside TensorBoard on localhost (scripts/e2e_browser.py).

Skipped where Debian's Chromium or the Playwright driver is missing: `make e2e` installs both and
is the real gate. Here the runs are the tests' own (tests/trace_runs.py), so no strategy is needed.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.trace_runs import shared_logdir

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import e2e_browser  # noqa: E402

pytestmark = pytest.mark.skipif(
    not Path(e2e_browser.CHROMIUM).exists() or importlib.util.find_spec("playwright") is None,
    reason="needs /usr/bin/chromium and playwright (make e2e installs them)")


def test_timeline_renders_and_nothing_leaves_localhost(tmp_path, tmp_path_factory):
    logdir, _ = shared_logdir(tmp_path_factory)
    result = e2e_browser.check(logdir, tmp_path / "plugin.png")
    assert result["offsite_requests"] == [] and result["csp_refusals"] == []
    pages = result["pages"]
    for name in ("tensorboard", "standalone"):   # both open the first run: the real 2-rank one
        page = pages[name]
        assert page["state"] == "ready", (name, page)
        assert page["bars"] > 0 and page["lanes"] == 2 * 3, (name, page)   # 2 ranks x 3 rows
        assert page["comm_rows"] == 2 and page["memory_bars"] == 2 * 4, (name, page)
    assert (tmp_path / "plugin.png").stat().st_size > 10_000


def test_report_page_makes_no_request_off_the_machine(tmp_path):
    result = e2e_browser.check_report(e2e_browser.report_page(tmp_path))
    assert result["offsite_requests"] == [] and result["widget_text_kept"], result
