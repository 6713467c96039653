"""A progress bar that renders as a widget in a notebook and as text in a terminal.

In a Jupyter kernel tqdm's notebook front end (`tqdm.notebook`, an ipywidgets progress bar) is
used when ipywidgets is installed; without it, an HTML <progress> element updated in place through
IPython's display machinery, which draws in JupyterLab and in exported pages. Either way nothing
is written to stderr, so an executed notebook has no red stream block where the bar was. Outside
a kernel (scripts, the terminal) it is tqdm's text bar.
"""
from __future__ import annotations

import html


def in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and "IPKernelApp" in shell.config


class HtmlBar:
    """The few tqdm methods the callers use (`update`, `n`, context manager), drawn as HTML."""

    def __init__(self, total: int, desc: str = "", unit: str = "it", **_):
        from IPython.display import display

        self.total, self.desc, self.unit, self.n = total, desc, unit, 0
        self._handle = display(self._html(), display_id=True)

    def _html(self):
        from IPython.display import HTML

        label = html.escape(f"{self.desc}: {self.n}/{self.total} {self.unit}")
        return HTML(f'<progress value="{self.n}" max="{self.total}" style="width:40%"></progress> '
                    f'<span style="font-family:monospace">{label}</span>')

    def update(self, k: int = 1) -> None:
        if k:
            self.n += k
            self._handle.update(self._html())

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._handle.update(self._html())


def progress_bar(total: int, desc: str = "", unit: str = "it", **kw):
    """tqdm-like bar: widget in a notebook (tqdm.notebook, else HTML), tqdm's text bar elsewhere."""
    if in_notebook():
        try:
            import ipywidgets  # noqa: F401  (tqdm.notebook needs it)
            from tqdm.notebook import tqdm
        except ImportError:
            return HtmlBar(total, desc=desc, unit=unit)
        return tqdm(total=total, desc=desc, unit=unit, **kw)
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit=unit, **kw)
