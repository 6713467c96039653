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
