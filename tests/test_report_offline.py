"""`make report`'s pages carry no loader for outside scripts (scripts/make_report.py): checked on
the exported HTML here, without a browser (the browser check is tests/test_e2e_browser.py)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import e2e_browser  # noqa: E402
import make_report  # noqa: E402


def test_exported_page_has_no_widget_loader_and_keeps_the_text(tmp_path):
    html = e2e_browser.report_page(tmp_path).read_text()
    assert "unpkg.com" not in html and "embed-amd" not in html
    assert not re.search(r"""<script\b[^>]*\bsrc\s*=\s*["']?(?:https?:)?//""", html, re.I)
    assert "steps 3/3" in html


def test_drop_widgets_keeps_other_outputs():
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["widgets"] = {}
    nb.cells.append(nbformat.v4.new_code_cell("x", outputs=[
        nbformat.v4.new_output("display_data", data={make_report.WIDGET_VIEW: {"model_id": "a"}}),
        nbformat.v4.new_output("stream", name="stdout", text="hello")]))
    make_report.drop_widgets(nb)
    assert "widgets" not in nb.metadata
    assert [o["output_type"] for o in nb.cells[0].outputs] == ["stream"]
