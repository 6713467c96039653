"""A notebook's `##` sections, each one runnable from a fresh kernel after the set-up cell.

A learner who opens a notebook at §5 runs the first code cell (imports, the model, the runs every
section reads, each computed once per kernel) and then §5 alone. `sections` cuts a notebook that
way; `free_names` is the static check (a name a section reads that neither it nor the set-up cell
defines), `run_alone` the real one (a fresh kernel per section, through nbclient)."""
from __future__ import annotations

import ast
import builtins
import copy
import json
import re
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
HEADING = re.compile(r"^## ")
# names IPython puts in every kernel
KERNEL_NAMES = {"display", "get_ipython", "In", "Out", "_", "__"}


def _source(cell) -> str:
    s = cell["source"]
    return s if isinstance(s, str) else "".join(s)


def sections(nb: dict) -> tuple[int, list[tuple[str, list[int]]]]:
    """(index of the set-up cell, [(heading, indices of the section's code cells)]). The set-up
    cell is the first code cell; code before the first `##` heading after it is its own section."""
    cells = nb["cells"]
    setup = next(i for i, c in enumerate(cells) if c["cell_type"] == "code")
    out: list[tuple[str, list[int]]] = []
    for i, cell in enumerate(cells[setup + 1:], setup + 1):
        text = _source(cell).lstrip()
        if cell["cell_type"] == "markdown" and HEADING.match(text):
            out.append((text.splitlines()[0], []))
        elif cell["cell_type"] == "code":
            if not out:
                out.append(("(before the first section)", []))
            out[-1][1].append(i)
    return setup, [s for s in out if s[1]]


def _python(code: str) -> str:
    """The cell without IPython's magics and shell lines (not Python)."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                     for line in code.splitlines())


def defined_and_read(code: str) -> tuple[set[str], set[str]]:
    """Names the code binds anywhere (assignments, imports, defs, arguments, loop and comprehension
    targets) and names it reads. Coarse on purpose: a name bound anywhere counts as defined."""
    tree = ast.parse(_python(code))
    bound, read = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return bound, read


def free_names(nb: dict) -> dict[str, list[str]]:
    """heading -> the names its code reads that neither it nor the set-up cell defines."""
    setup, parts = sections(nb)
    known = defined_and_read(_source(nb["cells"][setup]))[0] | set(dir(builtins)) | KERNEL_NAMES
    out = {}
    for heading, idx in parts:
        bound, read = defined_and_read("\n".join(_source(nb["cells"][i]) for i in idx))
        missing = sorted(read - bound - known)
        if missing:
            out[heading] = missing
    return out


def section_notebook(nb: dict, setup: int, idx: list[int]) -> dict:
    """A notebook of the set-up cell and one section's code cells, outputs cleared."""
    one = copy.deepcopy(nb)
    one["cells"] = [copy.deepcopy(nb["cells"][i]) for i in [setup, *idx]]
    for cell in one["cells"]:
        cell["source"] = _source(cell)               # nbclient wants one string, as nbformat reads it
        cell["outputs"], cell["execution_count"] = [], None
    return one


def run_alone(path: Path, timeout: int = 600) -> list[str]:
    """Run every section of `path` in a fresh kernel after the set-up cell; the failures, one line
    each (heading and the error's last line)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = json.loads(path.read_text())
    setup, parts = sections(nb)
    failures = []
    for heading, idx in parts:
        one = nbformat.from_dict(section_notebook(nb, setup, idx))
        client = NotebookClient(one, timeout=timeout, kernel_name="python3",
                                resources={"metadata": {"path": str(path.parent)}})
        try:
            client.execute()
        except CellExecutionError as e:
            last = [line for line in str(e).strip().splitlines() if line.strip()][-1:]
            failures.append(f"{path.name} {heading}: {' '.join(last)[:300]}")
    return failures
