"""Show a core function's source in a notebook, beside the run that uses it.

    show(NaiveDataParallel.sync_gradients)     # prints refimpl/parallel/dp/naive.py:18 and the code

`show` refuses anything defined outside the core (refimpl/ without refimpl/lab/): a notebook
that says "this is the mechanism" then points at the one a learner reads."""
from __future__ import annotations

import inspect
from pathlib import Path

import refimpl

PACKAGE = Path(refimpl.__file__).parent


def where(obj) -> str:
    """`obj`'s file, relative to the project, and its first line: refimpl/parallel/dp/naive.py:18."""
    path = Path(inspect.getsourcefile(obj)).resolve()
    core = path.is_relative_to(PACKAGE) and not path.is_relative_to(PACKAGE / "lab")
    if not core:
        raise ValueError(f"{obj.__qualname__} is defined in {path}, outside refimpl's core")
    return f"{path.relative_to(PACKAGE.parent)}:{inspect.getsourcelines(obj)[1]}"


def show(*objs) -> str:
    """Print each object's location and source; return the text (one string) as well."""
    text = "\n".join(f"# {where(o)}\n{inspect.getsource(o)}" for o in objs)
    print(text)
    return text
