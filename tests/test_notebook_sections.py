"""Every `##` section of every notebook runs from a fresh kernel after the notebook's set-up cell
(issue 53): no section reads a name another section defined. The static check runs in make test
(a second); running each section alone in its own kernel is make test-full's (nbval runs every
notebook whole in make test)."""
from __future__ import annotations

import json

import pytest

from tests.notebook_sections import NOTEBOOKS, free_names, run_alone, sections

PATHS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def test_the_splitter_finds_each_notebooks_sections():
    assert len(PATHS) == 12
    for path in PATHS:
        setup, parts = sections(json.loads(path.read_text()))
        assert len(parts) >= 3, path.name


def test_the_static_check_sees_a_name_from_another_section():
    nb = {"cells": [{"cell_type": "code", "source": "import math\nA = 1"},
                    {"cell_type": "markdown", "source": "## 1. first"},
                    {"cell_type": "code", "source": "b = A + math.pi\nprint(b)"},
                    {"cell_type": "markdown", "source": "## 2. second"},
                    {"cell_type": "code", "source": "%time c = [b * k for k in range(3)]\nc = b"}]}
    assert free_names(nb) == {"## 2. second": ["b"]}


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_no_section_reads_what_another_section_defined(path):
    missing = free_names(json.loads(path.read_text()))
    assert not missing, "; ".join(f"{h[:50]} reads {', '.join(n)}" for h, n in missing.items())


@pytest.mark.ranks
@pytest.mark.full
@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_each_section_runs_alone_in_a_fresh_kernel(path):
    failures = run_alone(path)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_the_notebook_is_valid_nbformat_with_unique_cell_ids(path):
    """nbformat 4.5 gives every cell an id, unique in the notebook (JupyterLab and nbclient warn on
    a missing one and assign their own, which then shows up as a diff on every save). Read from the
    file's JSON: nbformat.read fills a missing id in silently."""
    import nbformat

    raw = json.loads(path.read_text())
    ids = [cell.get("id") for cell in raw["cells"]]
    assert None not in ids and len(set(ids)) == len(ids), [i for i in ids if ids.count(i) > 1 or i is None]
    nbformat.validate(nbformat.from_dict(raw))
