"""Execute every notebook and export each as an HTML page with its figures, for reading offline.

    python scripts/make_report.py [--notebooks notebooks] [--out report]      (or: make report)

Writes report/<notebook>.html, one per notebook, and report/index.html listing them in notebook
order (00_… to 09_…) with how each run went. A notebook that fails is still exported, up to and
including the failing cell, and marked FAILED in the index; the script then exits 1.

Offline. Figures: refimpl.lab.plots sets plotly's `plotly_mimetype+notebook` renderer, whose HTML output
embeds plotly.js once per notebook, so the exported figures draw without a network. What nbconvert
and plotly would still fetch from CDNs is replaced or dropped here:
  * MathJax (the formulas in the prose): a local copy, from the jupyter-server-mathjax package,
    copied into report/mathjax/ (when that package is missing, nbconvert's CDN link stays);
  * require.js (nbconvert's template) and plotly's per-figure MathJax 3 tag: dropped, nothing here
    needs them;
  * the widget state (the progress bars of refimpl.lab.progress): dropped before the export, with each
    widget output's view, leaving its text. nbconvert's template otherwise adds a loader that
    fetches @jupyter-widgets/html-manager's embed-amd.js from unpkg.com, and no installed package
    ships that bundle. A finished progress bar has nothing left to show that its text does not.
`scripts/e2e_browser.py --report` opens an exported page in headless Chromium and fails on any
request that leaves the machine.
"""
from __future__ import annotations

import argparse
import html
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXTERNAL_SCRIPT = re.compile(r"""<script\b[^>]*\bsrc\s*=\s*["']?(?:https?:)?//[^>]*>\s*</script>""",
                             re.I)


@dataclass
class Page:
    notebook: Path
    title: str
    seconds: float
    error: str | None


def execute(path: Path, timeout: int) -> tuple[object, str | None]:
    """Run every cell with the notebook's own folder as the working directory."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
    except CellExecutionError as e:
        last_line = str(e).strip().splitlines()[-1]
        return nb, re.sub(r"\x1b\[[0-9;]*m", "", last_line)   # without the terminal colours
    return nb, None


def local_mathjax(out: Path) -> str | None:
    """Copy MathJax 2 next to the pages; return the URL the pages should load it from."""
    try:
        import jupyter_server_mathjax
    except ImportError:
        return None
    source = Path(jupyter_server_mathjax.__file__).parent / "static"
    target = out / "mathjax"
    if not target.exists():
        shutil.copytree(source, target)
    return "mathjax/MathJax.js?config=TeX-AMS-MML_HTMLorMML-full,Safe"


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def drop_widgets(nb) -> None:
    """Remove the notebook's widget state and every output's widget view (keeping its text)."""
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for out in cell.outputs:
            out.get("data", {}).pop(WIDGET_VIEW, None)
        cell.outputs = [o for o in cell.outputs if "data" not in o or o["data"]]


def export(nb, target: Path, mathjax_url: str | None) -> None:
    from nbconvert import HTMLExporter

    drop_widgets(nb)

    exporter = HTMLExporter(template_name="lab")
    if mathjax_url:
        exporter.mathjax_url = mathjax_url
    body, _ = exporter.from_notebook_node(nb)
    target.write_text(EXTERNAL_SCRIPT.sub("", body))


def title_of(nb, fallback: str) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return fallback


def write_index(out: Path, pages: list[Page]) -> Path:
    rows = "\n".join(
        f'<tr><td><a href="{html.escape(p.notebook.stem)}.html">{html.escape(p.notebook.name)}'
        f"</a></td><td>{html.escape(p.title)}</td><td>{p.seconds:.0f} s</td>"
        f"<td>{'ok' if p.error is None else 'FAILED: ' + html.escape(p.error)}</td></tr>"
        for p in pages) or '<tr><td colspan="4">No notebooks found.</td></tr>'
    index = out / "index.html"
    index.write_text(f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Distributed training workbook: report</title>
<style>body {{ font: 15px/1.5 system-ui, sans-serif; margin: 2em auto; max-width: 60em; }}
td, th {{ padding: 4px 12px; border-bottom: 1px solid #ddd; text-align: left; }}</style></head>
<body><h1>Distributed training workbook</h1>
<p>Every notebook, executed on {time.strftime('%Y-%m-%d %H:%M')}, with its figures.</p>
<table><tr><th>notebook</th><th>title</th><th>run time</th><th>result</th></tr>
{rows}
</table></body></html>
""")
    return index


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--notebooks", type=Path, default=REPO / "notebooks")
    p.add_argument("--out", type=Path, default=REPO / "report")
    p.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    mathjax_url = local_mathjax(args.out)

    pages = []
    for path in sorted(args.notebooks.glob("*.ipynb")):
        print(f"executing {path.name} …", flush=True)
        start = time.monotonic()
        nb, error = execute(path, args.timeout)
        export(nb, args.out / f"{path.stem}.html", mathjax_url)
        pages.append(Page(path, title_of(nb, path.stem), time.monotonic() - start, error))
        print(f"  {'ok' if error is None else 'FAILED: ' + error} "
              f"({pages[-1].seconds:.0f} s)", flush=True)
    index = write_index(args.out, pages)
    print(f"wrote {index}")
    return 0 if all(p.error is None for p in pages) else 1


if __name__ == "__main__":
    sys.exit(main())
