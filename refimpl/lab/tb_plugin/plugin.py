"""The TensorBoard side of the rank-timeline plugin: its routes, and what each one returns.

TensorBoard mounts every route below under `/data/plugin/refimpl_timeline/`. Its frontend loads
`index.js` in an iframe and calls `render()`; the page then asks the JSON routes for data. The
same page is also served on its own at `.../refimpl_timeline/index.html`.

    runs                       the runs under the logdir: [{run, ranks, has_summary}]
    timeline?run=R&steps=a:b   every rank's labelled ranges in profiled steps a..b
    breakdown?run=R&steps=a:b  compute / comm / overlap / idle per rank and per (step, rank)
    comm?run=R&steps=a:b       count, bytes, time, bandwidth per (op, rank)
    memory?run=R               bytes per rank by category (from run_summary.json)
    merged?run=R               the run as one Chrome trace, a lane per rank (for Perfetto)

Nothing the plugin serves comes from, or points to, another host: plotly.js is the copy the plotly
Python package ships, served from here. That is the point of the plugin (see tb_plugin/__init__).
"""
from __future__ import annotations

import json
from pathlib import Path

from tensorboard.backend import http_util
from tensorboard.plugins import base_plugin
from werkzeug import wrappers

from refimpl.lab.tb_plugin import PLUGIN_NAME, TAB_NAME
from refimpl.lab.tb_plugin.runs import RunCache, find_runs

STATIC = Path(__file__).parent / "static"
_STATIC_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html"}


def plotly_js_path() -> Path:
    """plotly.min.js as the plotly Python package ships it (its version matches the notebooks')."""
    import plotly

    return Path(plotly.__file__).parent / "package_data" / "plotly.min.js"


class RankTimelinePlugin(base_plugin.TBPlugin):
    """One lane per rank on a shared time axis, plus the tables that explain it."""

    plugin_name = PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext):
        self.logdir = Path(context.logdir or ".").expanduser().resolve()
        self.cache = RunCache(self.logdir)

    def is_active(self) -> bool:
        runs = find_runs(self.logdir)
        if runs:
            self.cache.warm()   # TensorBoard asks this on page load: parse traces before the click
        return bool(runs)

    def frontend_metadata(self):
        return base_plugin.FrontendMetadata(es_module_path="/index.js", tab_name=TAB_NAME,
                                            disable_reload=False)

    def get_plugin_apps(self):
        apps = {f"/{name}": self._static_app(name)
                for name in ("index.js", "index.html", "standalone.js", "style.css")}
        apps.update({
            "/plotly.min.js": self._serve_plotly,
            "/runs": self._serve_runs,
            "/timeline": self._data_route("timeline"),
            "/breakdown": self._data_route("breakdown"),
            "/comm": self._data_route("communication"),
            "/memory": self._serve_memory,
            "/merged": self._serve_merged,
        })
        return apps

    # --- static files ---------------------------------------------------------------------------

    def _static_app(self, name: str):
        path = STATIC / name
        content_type = _STATIC_TYPES[path.suffix]

        @wrappers.Request.application
        def serve(request):
            # HTML gets TensorBoard's Content-Security-Policy: scripts from this origin only.
            return http_util.Respond(request, path.read_bytes(), content_type)

        return serve

    @wrappers.Request.application
    def _serve_plotly(self, request):
        # Cacheable for an hour: 4.8 MB that only changes when the plotly package does.
        return http_util.Respond(request, plotly_js_path().read_bytes(), "text/javascript",
                                 expires=3600)

    # --- data -----------------------------------------------------------------------------------

    @wrappers.Request.application
    def _serve_runs(self, request):
        from refimpl.lab.trace.profiling import trace_files
        from refimpl.lab.trace.run_record import SUMMARY_NAME
        from refimpl.lab.trace.views import run_label

        runs = [{"run": run_label(run.resolve(), self.logdir), "ranks": len(trace_files(run)),
                 "has_summary": (run / SUMMARY_NAME).exists()}
                for run in find_runs(self.logdir)]
        return _json(request, {"runs": runs})

    def _data_route(self, view: str):
        """A route computing `refimpl.lab.trace.views.<view>(df, window)` for ?run=&steps=."""

        @wrappers.Request.application
        def serve(request):
            from refimpl.lab.trace import views as trace_views

            try:
                run = self.cache.resolve(request.args.get("run", ""))
            except KeyError:
                return _json(request, {"error": "no such run"}, code=404)
            df = self.cache.frame(run)
            steps = trace_views.profiled_steps(df)
            try:
                window = trace_views.StepWindow.parse(request.args.get("steps"), steps)
            except ValueError as e:
                return _json(request, {"error": str(e)}, code=400)
            body = getattr(trace_views, view)(df, window)
            body.update(run=request.args["run"], steps=steps, window=window.as_list())
            if view == "timeline":
                body["colors"] = _phase_colors()
            return _json(request, body)

        return serve

    @wrappers.Request.application
    def _serve_memory(self, request):
        from refimpl.lab.trace.run_record import read_run_summary
        from refimpl.lab.trace.views import memory

        try:
            run = self.cache.resolve(request.args.get("run", ""))
        except KeyError:
            return _json(request, {"error": "no such run"}, code=404)
        return _json(request, memory(read_run_summary(run)))

    @wrappers.Request.application
    def _serve_merged(self, request):
        from refimpl.lab.trace.merge import merged_trace

        try:
            run = self.cache.resolve(request.args.get("run", ""))
        except KeyError:
            return _json(request, {"error": "no such run"}, code=404)
        name = request.args["run"].replace("/", "_") + ".merged.trace.json"
        download = ("Content-Disposition", f'attachment; filename="{name}"')
        return http_util.Respond(request, json.dumps(merged_trace(run)), "application/json",
                                 headers=[download])


def _json(request, body: dict, code: int = 200):
    return http_util.Respond(request, body, "application/json", code=code)


def _phase_colors() -> dict:
    """The workbook's palette, so the plugin and the notebooks' figures colour phases alike."""
    from refimpl.lab.plots import PHASE_COLORS

    return dict(PHASE_COLORS)
