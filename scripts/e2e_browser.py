"""End-to-end: TensorBoard on localhost, a 2-rank run, the rank-timeline plugin in headless Chromium

    python scripts/e2e_browser.py [--logdir DIR] [--screenshot /tmp/plugin.png] [--docs]

Fails (exit 1) unless, in TensorBoard's own page (http://127.0.0.1:PORT/#refimpl_timeline) and in
the plugin's standalone page, the timeline renders with bars for every rank, a 4-rank, 10-step run
draws in under 2 s (--max-open-s), and no request leaves 127.0.0.1. Every request the browser makes
is routed through this script: one to another host is recorded and aborted (so the check cannot
pass by the network being down), and a Content-Security-Policy refusal in the console counts as an
attempt too (TensorBoard's CSP blocks scripts from other hosts before any request exists).
Run by `make e2e`; `tests/test_e2e_browser.py` calls `check()` and `check_report()`. The report's
pages (scripts/make_report.py) are checked the same way: a page exported from a notebook that has
a progress widget's state and a formula is opened from file:// and must make no request off the
machine (nbconvert's widget loader would fetch embed-amd.js from unpkg.com).

The runs: `python -m refimpl train --strategy dp --nproc 2 --profile` with small buckets (so
all-reduces overlap the backward pass), or, if no `dp` strategy is registered, the tests' 2-rank
all-reduce run; and the tests' synthetic 4-rank, 10-step trace (a real one takes minutes on a
2-core laptop).
"""
from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
# What the workplace's headless Chromium needs so that it does not phone home on its own.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run"]
PLUGIN = "refimpl_timeline"


sys.path.insert(0, str(REPO))
# BIG_RUN: 4 ranks x 10 profiled steps, synthetic; the page must draw it in under 2 s.
from tests.trace_runs import BIG_RUN, write_synthetic_run  # noqa: E402


def make_runs(logdir: Path) -> Path:
    """A 2-rank profiled run, and a synthetic 4-rank, 10-step one, under logdir."""
    from refimpl.registry import strategies

    write_synthetic_run(logdir / BIG_RUN, ranks=4, steps=10)

    run = logdir / "e2e" / "dp-n2"
    if "dp" in strategies():
        subprocess.run([sys.executable, "-m", "refimpl", "train", "--strategy", "dp", "--nproc",
                        "2", "--steps", "5", "--profile", "--set", "bucket_mb=0.25",
                        "--trace-dir", str(run), "--json"],
                       check=True, cwd=REPO, stdout=subprocess.DEVNULL, timeout=600)
    else:
        from tests.trace_runs import make_run as allreduce_run

        run = logdir / "e2e" / "allreduce-n2"
        allreduce_run(run, 2, 5)
    return run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_tensorboard(logdir: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir),
                             "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/plugins_listing",
                                        timeout=5) as r:
                listing = json.load(r)
            if listing.get(PLUGIN, {}).get("enabled"):
                return proc
        except OSError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"tensorboard exited with code {proc.returncode}")
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError("tensorboard did not list the plugin as enabled within 120 s")


def _wait_ready(page, frame_of, timeout_s: float = 60.0):
    """Poll until the plugin page says ready (or error); returns (frame, state, seconds)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        frame = frame_of()
        if frame is not None:
            state = frame.evaluate("document.body && document.body.dataset.state")
            if state in ("ready", "error", "empty"):
                return frame, state, time.monotonic() - start
        page.wait_for_timeout(100)   # not time.sleep: Playwright handles its events meanwhile
    return frame_of(), "timeout", time.monotonic() - start


def _inspect(frame) -> dict:
    return frame.evaluate("""() => ({
        status: document.getElementById('status').textContent,
        bars: document.querySelectorAll('#timeline .trace.bars .point').length,
        lanes: document.querySelectorAll('#timeline .yaxislayer-above .ytick').length,
        comm_rows: document.querySelectorAll('#comm tbody tr').length,
        memory_bars: document.querySelectorAll('#memory .trace.bars .point').length,
    })""")


def check(logdir: Path, screenshot: Path, chromium: str = CHROMIUM) -> dict:
    """Open the plugin inside TensorBoard and on its own; report what rendered and what left."""
    from playwright.sync_api import sync_playwright

    port = free_port()
    origin = f"http://127.0.0.1:{port}"
    offsite, refusals, pages = [], [], {}
    tb = start_tensorboard(logdir, port)
    profile_dir = tempfile.mkdtemp(prefix="e2e-chromium-")
    try:
        with sync_playwright() as pw:
            context = pw.chromium.launch_persistent_context(
                profile_dir, executable_path=chromium, args=CHROMIUM_FLAGS, headless=True,
                viewport={"width": 1400, "height": 1000})

            def gate(route):
                url = route.request.url
                if url.startswith(origin + "/") or url.split(":", 1)[0] in ("data", "blob"):
                    route.continue_()
                else:
                    offsite.append(url)
                    route.abort()

            context.route("**/*", gate)
            page = context.pages[0] if context.pages else context.new_page()
            page.on("console", lambda m: refusals.append(m.text)
                    if "Content Security Policy" in m.text or "Refused to" in m.text else None)

            page.goto(f"{origin}/#{PLUGIN}")
            frame, state, seconds = _wait_ready(
                page, lambda: next((f for f in page.frames if "plugin_entry.html" in f.url), None))
            pages["tensorboard"] = dict(_inspect(frame) if frame else {}, state=state,
                                        seconds=round(seconds, 2))
            page.wait_for_timeout(300)   # let plotly finish its last relayout before the picture
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(screenshot))

            page.goto(f"{origin}/data/plugin/{PLUGIN}/index.html")
            frame, state, seconds = _wait_ready(page, lambda: page.main_frame)
            pages["standalone"] = dict(_inspect(frame), state=state, seconds=round(seconds, 2))

            if (logdir / BIG_RUN).is_dir():   # seconds: from asking for the page to a drawn one
                page.goto(f"{origin}/data/plugin/{PLUGIN}/index.html?run={BIG_RUN}")
                frame, state, seconds = _wait_ready(page, lambda: page.main_frame)
                pages["4 ranks x 10 steps"] = dict(_inspect(frame), state=state,
                                                   seconds=round(seconds, 2))
            context.close()
    finally:
        tb.terminate()
        tb.wait(timeout=30)
        shutil.rmtree(profile_dir, ignore_errors=True)

    ok = (not offsite and not refusals
          and all(p.get("state") == "ready" and p.get("bars", 0) > 0 for p in pages.values()))
    return {"ok": ok, "pages": pages, "offsite_requests": offsite, "csp_refusals": refusals,
            "screenshot": str(screenshot)}


def report_page(folder: Path) -> Path:
    """A page as `make report` exports it, from a notebook with widget state, a widget output and
    a formula (the report's other outside fetches: the widget loader, MathJax)."""
    import nbformat

    sys.path.insert(0, str(REPO / "scripts"))
    import make_report

    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_markdown_cell("A ring sends $2(t-1)/t$ of the message."))
    view = {"model_id": "bar", "version_major": 2, "version_minor": 0}
    nb.cells.append(nbformat.v4.new_code_cell("progress()", outputs=[nbformat.v4.new_output(
        "display_data", data={make_report.WIDGET_VIEW: view, "text/plain": "steps 3/3"})]))
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {
        "state": {"bar": {"model_name": "IntProgressModel", "model_module": "@jupyter-widgets/controls",
                          "model_module_version": "2.0.0", "state": {"value": 3, "max": 3}}},
        "version_major": 2, "version_minor": 0}}
    page = folder / "page.html"
    make_report.export(nb, page, make_report.local_mathjax(folder))
    return page


def check_report(page: Path, chromium: str = CHROMIUM) -> dict:
    """Open an exported report page from file://; every request that is not a local file is
    recorded and aborted."""
    from playwright.sync_api import sync_playwright

    offsite = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS, headless=True)
        page_ = browser.new_page()

        def gate(route):
            url = route.request.url
            if url.split(":", 1)[0] in ("file", "data", "blob"):
                route.continue_()
            else:
                offsite.append(url)
                route.abort()

        page_.route("**/*", gate)
        page_.goto(page.resolve().as_uri(), wait_until="load")
        page_.wait_for_timeout(1500)     # the loaders run on DOMContentLoaded and after
        text = page_.inner_text("body")
        browser.close()
    return {"ok": not offsite, "offsite_requests": offsite, "widget_text_kept": "steps 3/3" in text}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--logdir", type=Path, default=None, help="default: a fresh temporary folder")
    p.add_argument("--screenshot", type=Path, default=Path("/tmp/plugin.png"))
    p.add_argument("--docs", action="store_true",
                   help="also copy the screenshot to docs/plugin.png")
    p.add_argument("--max-open-s", type=float, default=2.0,
                   help="fail if the 4-rank, 10-step run takes this long to draw")
    args = p.parse_args()
    if not Path(CHROMIUM).exists():
        print(f"{CHROMIUM} not found: `make e2e` installs Debian's chromium", file=sys.stderr)
        return 1
    logdir = args.logdir or Path(tempfile.mkdtemp(prefix="e2e-logdir-"))
    make_runs(logdir)
    result = check(logdir, args.screenshot)
    result["report"] = check_report(report_page(Path(tempfile.mkdtemp(prefix="e2e-report-"))))
    result["ok"] = result["ok"] and result["report"]["ok"]
    big = result["pages"].get("4 ranks x 10 steps", {})
    if big.get("seconds", float("inf")) >= args.max_open_s:
        result["ok"] = False
        result["too_slow"] = f"{BIG_RUN} took {big.get('seconds')} s (limit {args.max_open_s} s)"
    if args.docs:
        (REPO / "docs").mkdir(exist_ok=True)
        shutil.copyfile(args.screenshot, REPO / "docs" / "plugin.png")
    print(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
