"""The progress bar writes nothing to stderr in a notebook kernel; tqdm's text bar elsewhere."""
import pytest

from refimpl.lab import progress


def test_outside_a_kernel_it_is_tqdms_text_bar():
    from tqdm import tqdm

    bar = progress.progress_bar(3, desc="x", disable=True)
    assert isinstance(bar, tqdm) and not progress.in_notebook()
    bar.close()


def test_html_bar_updates_in_place(monkeypatch):
    pytest.importorskip("IPython")
    shown = []

    class Handle:
        def update(self, obj):
            shown.append(obj.data)

    monkeypatch.setattr("IPython.display.display", lambda obj, display_id=None: shown.append(obj.data) or Handle())
    with progress.HtmlBar(4, desc="sweep", unit="pt") as bar:
        bar.update(3)
        bar.update(0)
    assert bar.n == 3 and len(shown) == 3
    assert '<progress value="3" max="4"' in shown[-1] and "sweep: 3/4 pt" in shown[-1]
